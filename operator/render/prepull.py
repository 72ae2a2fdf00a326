"""A pre-pull pod (spec.model.prePull), pure: before a replica group's pods are created, one
short-lived pod on each node of its plan fetches what the group's pods on that node will load into
the node's cache, so that the group starts from a warm cache without holding its pods, or their
GPUs, while the files download, and every node downloads at once.

The pod is pinned with nodeName (the kubelet of that node runs it; no scheduling, no GPU asked). It
runs `shardwise fetch` of the operator's own worker image, never spec.image, one container per
pipeline stage placed on the node, each fetching that stage's share by the plan's layer split
(`--stage`, `--pipeline`, `--layers`): exactly the files a worker pod of that stage fetches. It is
given what a worker pod of the model is given to fetch, and nothing more: the credentials of the
uri's scheme (render/source.py), the node cache's hostPath and the init container that hands a new
namespace directory to the worker's group, the worker's security context, no service account
token. activeDeadlineSeconds bounds it; the operator gives up on it a little later in any case
(decide/prepull.py), and creates the group's pods whatever became of it.
"""
from __future__ import annotations

import hashlib
from typing import Any

from shardwise.crds import names
from shardwise.crds.models import ShardedModel
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.operator.render import renderer, source
from shardwise.operator.render.settings import Settings, current

ROLE = "model-prepull"
# A pre-pull pod runs at most this long (a stalled store, a share too large for its link): the
# group's pods are then created anyway and fetch what is missing themselves.
DEADLINE_SECONDS = 1800
GIB = 1 << 30


def pod_name(model: str, replica: int, attempt: int, node: str) -> str:
    """One pod per (replica group, attempt, node): a node's name may be 253 characters, so it goes in
    hashed."""
    digest = hashlib.sha256(f"{node}/{attempt}".encode()).hexdigest()[:8]
    return names.prepull_pod_name(model, replica, digest)


def plan_nodes(plan: ShardPlan, replica: int) -> list[str]:
    """The nodes of a replica group's plan, in stage order, each once."""
    return list(dict.fromkeys(p.node for p in plan.stages_of(replica)))


def _fetch(model: ShardedModel, plan: ShardPlan, placement: StagePlacement, settings: Settings) -> list[str]:
    m = model.spec.model
    budget = settings.model_cache_budget / GIB       # exact: the budget is a whole number of bytes
    return (["shardwise", "fetch", m.uri, "--cache", names.MODEL_CACHE_MOUNT, "--budget-gib", repr(budget),
             "--stage", str(placement.stage), "--pipeline", str(plan.pipeline),
             "--layers", f"{placement.layer_start}:{placement.layer_end}", *source.store_options(model, settings)]
            + (["--streams", str(m.fetch_streams)] if m.fetch_streams is not None else []))


def _container(model: ShardedModel, plan: ShardPlan, placement: StagePlacement, default_image: str,
               settings: Settings) -> dict:
    return {
        "name": f"stage-{placement.stage}", "image": default_image,
        "command": _fetch(model, plan, placement, settings),
        "env": [], "volumeMounts": [],
        # a failed fetch's last line (its one-line error) becomes the pod's termination message
        "terminationMessagePath": renderer.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # the fetcher's streams hold up to three 8 MiB chunks each (768 MiB at 32 streams)
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": renderer.WORKER_CONTAINER_SECURITY,
    }


def render(model: ShardedModel, plan: ShardPlan, replica: int, attempt: int, node: str,
           default_image: str = renderer.DEFAULT_IMAGE, settings: Settings | None = None) -> dict:
    """The pre-pull pod of one node of a replica group's plan."""
    settings = settings or current()
    stages = list({p.stage: p for p in plan.stages_of(replica) if p.node == node}.values())
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never", "nodeName": node,
        "containers": [_container(model, plan, p, default_image, settings) for p in stages],
        "volumes": [], "activeDeadlineSeconds": DEADLINE_SECONDS, "enableServiceLinks": False,
        "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
        "securityContext": dict(renderer.WORKER_POD_SECURITY),
    }
    source.apply_cache(pod_spec, model, settings, default_image)
    if model.spec.placement.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in model.spec.placement.tolerations]
    labels = {**renderer.model_labels(model.name), names.LABEL_ROLE: ROLE,
              names.LABEL_REPLICA: str(replica), names.LABEL_ATTEMPT: str(attempt),
              names.LABEL_SPEC_HASH: renderer.spec_hash(model.spec, default_image)}
    meta = {"name": pod_name(model.name, replica, attempt, node), "namespace": model.namespace,
            "labels": labels,
            "ownerReferences": [renderer.owner_reference(model)]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def is_prepull(pod: dict) -> bool:
    return (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == ROLE
