"""The one way from a parsed `model.uri` to the store that serves it: s3:// to S3Store, hf:// to
HubRemote, oci:// to OciRemote, each given the source's options (an S3 endpoint, region and
addressing) and only the credentials crds/names.py CREDENTIAL_ENV names for its scheme, read from
the environment the pod was given (its spec's Secret). `shardwise fetch`, `shardwise push`,
`shardwise inspect <uri>` and the pod's own fetch all open their store here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from shardwise.crds import names
from shardwise.crds.modelsource import HfUri, OciUri, ParsedUri, S3Uri, SourceScheme
from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch.registry import is_loopback
from shardwise.worker.fetch.remote import Remote


@dataclass(frozen=True)
class SourceOptions:
    """spec.model's options for a store (None: the store's default): an s3:// endpoint, region and
    addressing; whether an oci:// registry is spoken to in plain HTTP."""
    endpoint: Optional[str] = None
    region: Optional[str] = None
    path_style: bool = False
    plain_http: bool = False


def options_of(source) -> SourceOptions:
    """The options of a pod contract's `source` (crds/contract.py SourceContract)."""
    return SourceOptions(source.endpoint, source.region, bool(source.path_style), bool(source.plain_http))


def options_from_args(args) -> SourceOptions:
    """The options of `shardwise inspect` and `shardwise fetch` (crds/cli/inspect.py add_store_arguments)."""
    return SourceOptions(args.endpoint, args.region, bool(args.path_style), bool(args.plain_http))


def credentials(scheme: SourceScheme, env: Mapping[str, str]) -> dict[str, str]:
    """The credential variables of `scheme` that `env` sets (and nothing else of it)."""
    return {k: env[k] for k in names.CREDENTIAL_ENV.get(scheme.value, ()) if env.get(k)}


def open_remote(uri: ParsedUri, options: SourceOptions = SourceOptions(),
                env: Optional[Mapping[str, str]] = None) -> Remote:
    """The store of a remote uri; WorkerError (one line) for a path or a claim, which no store serves."""
    import os
    given = credentials(uri.scheme, os.environ if env is None else env)
    if isinstance(uri, S3Uri):
        from shardwise.worker.fetch.s3 import S3Config, S3Store
        config = S3Config(endpoint=options.endpoint, region=options.region or S3Config.region,
                          path_style=options.path_style)
        return S3Store(uri, config, given)
    if isinstance(uri, HfUri):
        from shardwise.worker.fetch.hub import HubRemote
        # "" and not None: the store must not fall back to a token the machine has saved
        return HubRemote(uri.repo, uri.revision, uri.file, token=given.get(names.ENV_HF_TOKEN) or "")
    if isinstance(uri, OciUri):
        from shardwise.worker.fetch.oci import OciRemote
        # A registry on this machine (a sidecar, a local test registry) speaks plain HTTP, as
        # docker's rule for localhost registries is; any other HTTPS, unless asked otherwise (a pod:
        # the operator's --plain-http-registry list; a command: its --plain-http).
        return OciRemote(uri.registry, uri.repository, uri.digest or uri.tag or "latest",
                         plain_http=options.plain_http or is_loopback(uri.registry),
                         username=given.get(names.ENV_OCI_USERNAME) or "",
                         password=given.get(names.ENV_OCI_PASSWORD))
    raise WorkerError(f"{uri.scheme.value} models are read where they are, not fetched from a store")
