"""spec.model's fields for a model fetched from where it lives (hf://, s3://, oci://): which uri
schemes the API accepts, the S3 endpoint, region and addressing, the Secret of credentials, where
the fetched files are cached, how many reads a pod's fetch keeps in flight and whether the operator
warms the planned nodes' caches first (FetchSettings, a base of
crds/models.py ModelSource); and the rules between them, as CEL for the API server and in Python
for `shardwise plan -f`, with one message each.

The full grammar of each scheme is the uri parser's; here only what the API server can refuse at
`kubectl apply`: an unknown scheme, a uri that does not have its scheme's shape, options that do
not belong to its scheme.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Optional

from pydantic import Field

from shardwise.crds.access import DNS_SUBDOMAIN_PATTERN
from shardwise.crds.apimodel import ApiModel
from shardwise.crds.modelsource import ModelUriError, parse_model_uri, scheme_of
from shardwise.crds.names import FETCH_STREAMS, MAX_FETCH_STREAMS

# The schemes whose models the pods fetch (into the node-local cache) before loading them.
REMOTE_SCHEMES = ("hf", "s3", "oci")
# Every scheme model.uri may carry; a uri without one is a path inside the pod.
KNOWN_SCHEMES = ("file", "pvc") + REMOTE_SCHEMES
ANY_SCHEME = r"^[A-Za-z][A-Za-z0-9+.-]*://"
KNOWN_SCHEME = r"^(" + "|".join(KNOWN_SCHEMES) + r")://"

# What each remote scheme's uri looks like (its parser checks the rest).
SCHEME_SHAPES = {
    "hf": (r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[^/@]+)?(/[^@]+)?$",
           "hf://<org>/<name>[@<revision>][/<file>]"),
    "s3": (r"^s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/.*)?$", "s3://<bucket>[/<prefix>]"),
    "oci": (r"^oci://[^/@]+/[^@]+(:[-A-Za-z0-9_.]+|@sha256:[a-f0-9]{64})$",
            "oci://<registry>/<repository>:<tag> or @sha256:<digest>"),
}
# hf:// with format gguf names the .gguf file inside the repository
HF_GGUF = r"^hf://[^/@]+/[^/@]+(@[^/@]+)?/.+[.]gguf$"   # no backslash: CEL string literals

UNKNOWN_SCHEME = ("model.uri has an unknown scheme: use a path, pvc://, hf://, s3:// or oci://")
S3_ONLY = "model.endpoint, model.region and model.pathStyle are for s3:// uris only"
REMOTE_ONLY = "model.fetchStreams is for hf://, s3:// and oci:// uris only"
PRE_PULL_REMOTE = "model.prePull is for hf://, s3:// and oci:// uris only"
PRE_PULL_NODE_CACHE = "model.prePull warms the node-local cache: it cannot go with model.cache pod"
HF_GGUF_FILE = "model.uri must name a .gguf file inside the repository (hf://<org>/<name>/<file>.gguf) when model.format is gguf"

# An S3-compatible endpoint: http(s), a host and an optional port and path; no user:password@ (the
# endpoint is written into the pod contract, which must carry no credential), no query or fragment.
ENDPOINT_PATTERN = r"^https?://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?(/[-A-Za-z0-9._~/]*)?$"
REGION_PATTERN = r"^[a-z0-9][-a-z0-9]*$"


def scheme(uri: str) -> str:
    """The uri's scheme ("hf", "s3", ...; "" for a path): the uri parser's reading of it."""
    return scheme_of(uri)


def is_remote(uri: str) -> bool:
    return scheme(uri) in REMOTE_SCHEMES


class ModelCache(str, Enum):
    """Where a pod keeps the files it fetched of a remote model."""

    NODE = "node"   # the node-local cache (a hostPath the chart names), shared by the namespace's pods on the node
    POD = "pod"     # an emptyDir of the pod: fetched again by every pod; for namespaces that refuse hostPath


class CredentialsRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description=(
        "A Secret in the model's namespace. Its pods get these keys of it as environment variables of "
        "the same name, each optional, none other: s3:// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN; hf:// HF_TOKEN; oci:// OCI_USERNAME, OCI_PASSWORD. The operator never "
        "reads it."))


class FetchSettings(ApiModel):
    """How a pod fetches a remote model: spec.model's fields beside the uri, endpoint and cache (a base
    of ModelSource, so they sit in spec.model). Unset by default: a model made before they existed
    keeps its spec hash, its contract and its pods."""

    fetch_streams: Optional[int] = Field(None, ge=1, le=MAX_FETCH_STREAMS, description=(
        f"hf://, s3://, oci://: reads each pod keeps in flight while it fetches (files at once, and "
        f"large files in byte-range parts), 1 to {MAX_FETCH_STREAMS}; 1 fetches one file after another. "
        f"Omitted: {FETCH_STREAMS}. Read when a pod starts: changing it restarts no pod."))
    pre_pull: Optional[bool] = Field(None, description=(
        "hf://, s3://, oci://: before a replica group's pods are created, fetch what each of its "
        "nodes will load into that node's cache with one short-lived pod per node, all nodes at once; "
        "the group's pods are created when every pre-pull pod is done (or failed or timed out: the pods "
        "then fetch the rest themselves). Neither pods nor GPUs are held while the files download. "
        "Needs the node-local cache (model.cache node). Default false; changing it restarts no pod."))


def cel_rules() -> list[tuple[str, str, str]]:
    """The CEL rules of spec.model about remote sources (self is spec.model)."""
    rules = [(f"!self.uri.matches('{ANY_SCHEME}') || self.uri.matches('{KNOWN_SCHEME}')", UNKNOWN_SCHEME, ".uri")]
    for name, (pattern, form) in SCHEME_SHAPES.items():
        rules.append((f"!self.uri.startsWith('{name}://') || self.uri.matches('{pattern}')",
                      f"model.uri must look like {form}", ".uri"))
    rules.append(("self.uri.startsWith('s3://') || (!has(self.endpoint) && !has(self.region) && "
                  "!has(self.pathStyle))", S3_ONLY, ".endpoint"))
    remote = "^(" + "|".join(REMOTE_SCHEMES) + ")://"
    rules.append((f"!has(self.fetchStreams) || self.uri.matches('{remote}')", REMOTE_ONLY, ".fetchStreams"))
    rules.append((f"!has(self.prePull) || !self.prePull || self.uri.matches('{remote}')", PRE_PULL_REMOTE,
                  ".prePull"))
    rules.append(("!has(self.prePull) || !self.prePull || !has(self.cache) || self.cache != 'pod'",
                  PRE_PULL_NODE_CACHE, ".prePull"))
    rules.append(("self.format != 'gguf' || !self.uri.startsWith('hf://') || "
                  f"self.uri.matches('{HF_GGUF}')", HF_GGUF_FILE, ".uri"))
    return rules


def problem(uri: str, fmt: str, endpoint: Optional[str], region: Optional[str],
            path_style: Optional[bool], fetch_streams: Optional[int] = None, pre_pull: Optional[bool] = None,
            cache: Optional[ModelCache] = None) -> str:
    """cel_rules in Python: the first rule the source breaks, "" when none."""
    if re.match(ANY_SCHEME, uri) and not re.match(KNOWN_SCHEME, uri):
        return UNKNOWN_SCHEME
    found = scheme(uri)
    if found in SCHEME_SHAPES and not re.match(SCHEME_SHAPES[found][0], uri):
        return f"model.uri must look like {SCHEME_SHAPES[found][1]}"
    if found != "s3" and (endpoint is not None or region is not None or path_style is not None):
        return S3_ONLY
    if fetch_streams is not None and found not in REMOTE_SCHEMES:
        return REMOTE_ONLY
    if pre_pull and found not in REMOTE_SCHEMES:
        return PRE_PULL_REMOTE
    if pre_pull and cache == ModelCache.POD:
        return PRE_PULL_NODE_CACHE
    if fmt == "gguf" and found == "hf" and not re.match(HF_GGUF, uri):
        return HF_GGUF_FILE
    if found in REMOTE_SCHEMES:
        try:    # beyond the API server's rules: the whole grammar of the scheme (offline only)
            parse_model_uri(uri)
        except ModelUriError as e:
            return str(e)
    return ""


def source_problem(source: "FetchSettings") -> str:
    """problem() of a whole spec.model (crds/models.py ModelSource)."""
    m = source
    return problem(m.uri, m.format, m.endpoint, m.region, m.path_style, m.fetch_streams,  # type: ignore[attr-defined]
                   m.pre_pull, m.cache)  # type: ignore[attr-defined]
