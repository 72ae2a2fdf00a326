"""What the pods of a remote model (spec.model.uri hf://, s3://, oci://) are given, pure: the
credentials, the cache they fetch into, and the contract's `source` block.

- Credentials: the Secret spec.model.credentialsRef names, key by key, as environment variables of
  the same name (valueFrom.secretKeyRef, optional), only the keys of the uri's scheme
  (crds/names.py CREDENTIAL_ENV). Never envFrom: a Secret's keys would become whatever variables
  its writer chose (LD_PRELOAD, PATH). The operator never reads the Secret, and no credential is in
  the contract.
- The cache: with spec.model.cache node (the default) and the operator's cache on
  (settings.model_cache_host_path), the node directory <hostPath>/<namespace>, type
  DirectoryOrCreate, mounted at names.MODEL_CACHE_MOUNT: shared by the namespace's pods on the node,
  never by another namespace's (whose pods could plant files a tenant's model would load, or read a
  private model). Handed to the worker's group by a root init container, as the local checkpoint
  tier's is. Otherwise (cache: pod, or the cache off) an emptyDir at the same path.
"""
from __future__ import annotations

import posixpath
from typing import Any

from shardwise.crds import names
from shardwise.crds.contract import SourceContract
from shardwise.crds.models import ModelCache, ShardedModel
from shardwise.crds.modelsource import ModelUriError, OciUri, parse_model_uri, registry_key
from shardwise.operator.render.localtier import normalised
from shardwise.operator.render.settings import Settings

VOLUME = "model-cache"
PREPARE_MOUNT = "/model-cache"   # where the preparing init container sees the directory


def cache_mode(model: ShardedModel, settings: Settings) -> ModelCache:
    """Where this model's pods cache: the node's cache only when the spec and the operator both allow it."""
    asked = model.spec.model.cache or ModelCache.NODE
    return ModelCache.NODE if asked == ModelCache.NODE and settings.model_cache_host_path else ModelCache.POD


def node_directory(model: ShardedModel, settings: Settings) -> str:
    """The node directory a model's pods mount: <hostPath>/<namespace>."""
    return posixpath.join(normalised(settings.model_cache_host_path), model.namespace)


def plain_http(model: ShardedModel, settings: Settings) -> bool:
    """Whether the model's pods and probe speak plain HTTP to its oci:// registry: only to one the
    operator's --plain-http-registry lists (the spec cannot ask for it: a tenant must not be able to
    send another tenant's registry credentials in clear). A loopback registry needs no listing (the
    worker's own rule, worker/fetch/stores.py)."""
    if model.spec.model.remote_scheme() != "oci" or not settings.plain_http_registries:
        return False
    try:
        parsed = parse_model_uri(model.spec.model.uri)
    except ModelUriError:      # refused where the spec is checked; never plain HTTP
        return False
    return isinstance(parsed, OciUri) and registry_key(parsed.registry) in settings.plain_http_registries


def contract(model: ShardedModel, settings: Settings) -> SourceContract | None:
    """The contract's `source` block; None for a model in a path or a claim."""
    m = model.spec.model
    scheme = m.remote_scheme()
    if not scheme:
        return None
    mode = cache_mode(model, settings)
    return SourceContract(uri=m.uri, scheme=scheme, endpoint=m.endpoint, region=m.region, path_style=m.path_style,
                          cache=mode, cache_dir=names.MODEL_CACHE_MOUNT,
                          cache_budget=settings.model_cache_budget if mode == ModelCache.NODE else None,
                          streams=m.fetch_streams, plain_http=plain_http(model, settings) or None)


def store_options(model: ShardedModel, settings: Settings) -> list[str]:
    """`shardwise inspect` and `shardwise fetch` options for an s3:// model's endpoint, region and
    addressing, and an oci:// model's plain HTTP."""
    m = model.spec.model
    return ([f"--endpoint={m.endpoint}"] if m.endpoint else []) + ([f"--region={m.region}"] if m.region else []) + (
        ["--path-style"] if m.path_style else []) + (["--plain-http"] if plain_http(model, settings) else [])


def credentials_env(model: ShardedModel) -> list[dict]:
    """The credential variables of the model's scheme, each from the Secret's key of the same name."""
    m = model.spec.model
    if m.credentials_ref is None:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": m.credentials_ref.name, "key": key,
                                                         "optional": True}}}
            for key in names.CREDENTIAL_ENV.get(m.remote_scheme(), ())]


def checkpoint_credentials_env(model: ShardedModel) -> list[dict]:
    """spec.checkpoint.credentialsRef's S3 keys under CHECKPOINT_CREDENTIAL_PREFIX (a pod may fetch its
    model from another store with other credentials)."""
    c = model.spec.checkpoint
    if c is None or c.uri is None or c.credentials_ref is None:
        return []
    return [{"name": names.CHECKPOINT_CREDENTIAL_PREFIX + key, "valueFrom": {"secretKeyRef": {
             "name": c.credentials_ref.name, "key": key, "optional": True}}}
            for key in names.CREDENTIAL_ENV["s3"]]


def cache_volume(model: ShardedModel, settings: Settings) -> tuple[dict, dict]:
    """(volume, mount) of the cache a pod fetches into."""
    if cache_mode(model, settings) == ModelCache.NODE:
        volume = {"name": VOLUME, "hostPath": {"path": node_directory(model, settings), "type": "DirectoryOrCreate"}}
    else:
        volume = {"name": VOLUME, "emptyDir": {}}
    return volume, {"name": VOLUME, "mountPath": names.MODEL_CACHE_MOUNT}


def _prepare(default_image: str) -> dict:
    """The init container that hands the namespace's cache directory to the worker's group (the
    kubelet makes it root-owned 0755; fsGroup does not apply to a hostPath): the operator's own
    worker image as root with no capability, as for the local checkpoint tier."""
    gid = names.WORKER_GID
    return {"name": "prepare-model-cache", "image": default_image,
            "command": ["sh", "-c", f"chgrp {gid} {PREPARE_MOUNT} && chmod 2770 {PREPARE_MOUNT}"],
            "volumeMounts": [{"name": VOLUME, "mountPath": PREPARE_MOUNT}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": {"runAsUser": 0, "runAsGroup": gid, "runAsNonRoot": False,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}


def apply(pod_spec: dict[str, Any], model: ShardedModel, settings: Settings, default_image: str) -> None:
    """Give a pod of a remote model its credentials and its cache, and a pod checkpointing to an
    object store that store's credentials (nothing for any other model)."""
    for container in pod_spec["containers"]:
        container["env"].extend(checkpoint_credentials_env(model))
    apply_cache(pod_spec, model, settings, default_image)


def apply_cache(pod_spec: dict[str, Any], model: ShardedModel, settings: Settings, default_image: str) -> None:
    """A remote model's credentials and cache, for a pod that fetches it (a worker pod, a pre-pull
    pod); nothing for a model in a path or a claim."""
    if not model.spec.model.remote_scheme():
        return
    volume, mount = cache_volume(model, settings)
    pod_spec["volumes"].append(volume)
    for container in pod_spec["containers"]:
        container["volumeMounts"].append(mount)
        container["env"].extend(credentials_env(model))
    if cache_mode(model, settings) == ModelCache.NODE:
        groups = pod_spec["securityContext"].get("supplementalGroups") or []
        pod_spec["securityContext"] = {**pod_spec["securityContext"],
                                       "supplementalGroups": sorted({*groups, names.WORKER_GID})}
        if settings.prepare_model_cache:
            pod_spec["initContainers"] = [*(pod_spec.get("initContainers") or []), _prepare(default_image)]
