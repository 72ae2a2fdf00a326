"""What the operator is configured with that shapes the objects it renders (`operator run`'s flags,
the chart's values): set once at start, read by the pure renderers (the default of their
`settings` argument), so that a unit test passes its own."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from shardwise.crds import names

DEFAULT_ROUTER_IMAGE = "ghcr.io/shardwise/operator:0.1.0"   # the chart's default operator image


@dataclasses.dataclass(frozen=True)
class Settings:
    # A NetworkPolicy per model (render/netpolicy.py); off for clusters without a policy engine.
    network_policy: bool = True
    # The operator's own pods, admitted to every model's serving port (a training pod's /progress):
    # their namespace ("" when the operator does not run in a pod) and their labels.
    operator_namespace: str = ""
    operator_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The node directories spec.checkpoint.local.hostPath may name (render/localtier.py).
    local_checkpoint_roots: tuple[str, ...] = (names.LOCAL_CHECKPOINT_ROOT,)
    # Hand a local tier's new directory to the worker's group with a root init container (the
    # kubelet makes it root-owned 0755); off: the node's directories must be prepared beforehand.
    prepare_local_checkpoints: bool = True
    # The node-local cache of remote models (render/source.py): the node directory ("" turns it off:
    # every pod fetches into an emptyDir of its own), the bytes it may hold, and whether a root init
    # container hands a namespace's new directory in it to the worker's group.
    model_cache_host_path: str = names.MODEL_CACHE_ROOT
    model_cache_budget: int = names.MODEL_CACHE_BUDGET
    prepare_model_cache: bool = True
    # The OCI registries (host[:port], crds/modelsource.py registry_key) that oci:// models' pods and
    # probes speak plain HTTP to (render/source.py plain_http): a cluster admin's choice, as
    # containerd's own list of insecure registries is, never a tenant's. Others: HTTPS.
    plain_http_registries: tuple[str, ...] = ()
    # The image of a model's router pods (render/router.py): the operator's own (the chart passes
    # its image); the worker image lacks the router's HTTP stack.
    router_image: str = DEFAULT_ROUTER_IMAGE


CURRENT = Settings()


def current() -> Settings:
    return CURRENT


def configure(settings: Settings) -> None:
    """Called once by `operator run`, before any model is reconciled."""
    global CURRENT
    CURRENT = settings
