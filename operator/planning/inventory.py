"""Node inventory: which nodes could hold a ShardedModel's pods, how many GPUs each has free, and
where each sits in the topology.

Input is what `kubectl get nodes,pods -A -o yaml` prints, as dicts (cli/plan.py turns the client
objects it reads from a cluster into the same dicts).
A node's free GPUs are its allocatable GPUs minus those requested by pods bound to it that have not
finished. `usable()` then keeps the nodes a given spec may use and counts why the others were left
out, so an infeasible plan can say so in one sentence.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from shardwise.crds import names
from shardwise.crds.models import DEFAULT_GPU_RESOURCE, GROUP, KIND, ShardedModelSpec, parse_quantity


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0                       # allocatable GPUs
    used: int = 0                       # GPUs requested by live pods on the node
    gpu_memory: int = 0                 # bytes per GPU; 0 = unknown
    ready: bool = True
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()

    @property
    def free(self) -> int:
        return max(0, self.gpus - self.used)

    @property
    def product(self) -> str:
        return self.labels.get(names.GPU_PRODUCT_LABEL, "")


def _int_quantity(value: Any) -> int:
    try:
        return int(parse_quantity(value))
    except ValueError:
        return 0


def pod_gpus(pod: Mapping[str, Any], resource_name: str = DEFAULT_GPU_RESOURCE) -> int:
    """GPUs a pod holds: sum over its containers, or the largest init container if that is more."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        return max(_int_quantity((res.get(kind) or {}).get(resource_name, 0)) for kind in ("limits", "requests"))

    main = sum(of(c) for c in spec.get("containers") or [])
    init = max((of(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def made_by_operator(pod: Mapping[str, Any]) -> bool:
    """The pod is one of a ShardedModel's: owned (ownerReference, as controller) by a ShardedModel
    whose name its model label carries. A label or an annotation alone is anyone's to write."""
    meta = pod.get("metadata") or {}
    model = (meta.get("labels") or {}).get(names.LABEL_MODEL)
    return bool(model) and any(
        ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
        and ref.get("name") == model and ref.get("controller") for ref in meta.get("ownerReferences") or [])


def counted_node(pod: Mapping[str, Any]) -> str | None:
    """The node whose GPUs a live pod holds: the one the scheduler bound it to, or for a pending pod
    the operator made, the node its plan put it on (ANNOTATION_PLANNED_NODE). Anyone else's pending
    pod holds nothing yet, whatever its annotations say."""
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        return node
    if made_by_operator(pod):
        return ((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_PLANNED_NODE)
    return None


def node_info(node: Mapping[str, Any], used: int = 0, resource_name: str = DEFAULT_GPU_RESOURCE) -> NodeInfo:
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    labels = dict(meta.get("labels") or {})
    allocatable = (status.get("allocatable") or status.get("capacity") or {}).get(resource_name, 0)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    memory_mib = labels.get(names.GPU_MEMORY_LABEL, "")
    taints = tuple(Taint(t.get("key", ""), t.get("value") or "", t.get("effect", "NoSchedule"))
                   for t in spec.get("taints") or [])
    return NodeInfo(name=meta.get("name", ""), labels=labels, gpus=_int_quantity(allocatable), used=used,
                    gpu_memory=int(memory_mib) * 2**20 if str(memory_mib).isdigit() else 0,
                    ready=ready, unschedulable=bool(spec.get("unschedulable")), taints=taints)


def build(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]] = (), resource_name: str = DEFAULT_GPU_RESOURCE,
          ignore_pod: Callable[[Mapping[str, Any]], bool] | None = None) -> list[NodeInfo]:
    """NodeInfo for every node, GPUs held by live pods subtracted.

    `ignore_pod` leaves pods out of the count, e.g. the pods of the very model being re-planned,
    whose kept placements the planner subtracts itself.
    """
    used: Counter[str] = Counter()
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and not (ignore_pod and ignore_pod(pod)):
            used[node_name] += pod_gpus(pod, resource_name)
    infos = [node_info(n, 0, resource_name) for n in nodes]
    return sorted((NodeInfo(**{**i.__dict__, "used": used[i.name]}) for i in infos), key=lambda i: i.name)


def load(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(nodes, pods) from a YAML file: a `kubectl get nodes[,pods] -o yaml` List, or documents."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read nodes ({str(e).splitlines()[0]})") from None
    items: list[dict[str, Any]] = []
    for doc in docs:
        items += doc.get("items") or [] if doc.get("kind", "").endswith("List") else [doc]
    nodes = [i for i in items if i.get("kind", "Node") == "Node"]
    pods = [i for i in items if i.get("kind") == "Pod"]
    if not nodes:
        raise ValueError(f"{path}: no Node objects (expected `kubectl get nodes -o yaml` output)")
    return nodes, pods


# ------------------------------------------------------------------ what a spec may use


def tolerated(taint: Taint, tolerations: Iterable[Any]) -> bool:
    if taint.effect == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.effect and t.effect != taint.effect:
            continue
        if t.operator == "Exists" and (not t.key or t.key == taint.key):
            return True
        if t.operator == "Equal" and t.key == taint.key and (t.value or "") == taint.value:
            return True
    return False


@dataclass
class Usable:
    nodes: list[NodeInfo]
    excluded: Counter[str] = field(default_factory=Counter)   # reason -> nodes

    def why_not(self) -> str:
        """'3 cordoned, 1 NotReady' - how the left-out nodes were lost, most first."""
        return ", ".join(f"{n} {reason}" for reason, n in self.excluded.most_common())


def usable(nodes: Iterable[NodeInfo], spec: ShardedModelSpec) -> Usable:
    """The nodes the spec's pods could run on, with free GPUs, and why the rest were left out."""
    min_memory = spec.gpu.min_memory_bytes()
    selector = spec.placement.node_selector
    out = Usable([])
    for node in nodes:
        if not node.ready:
            reason = "NotReady"
        elif node.unschedulable:
            reason = "cordoned"
        elif not all(tolerated(t, spec.placement.tolerations) for t in node.taints):
            bad = next(t for t in node.taints if not tolerated(t, spec.placement.tolerations))
            reason = f"tainted {bad.key}:{bad.effect}"
        elif any(node.labels.get(k) != v for k, v in selector.items()):
            reason = "not matching nodeSelector"
        elif node.gpus == 0:
            reason = f"without {spec.gpu.resource_name}"
        elif spec.gpu.product and node.product != spec.gpu.product:
            reason = f"not {spec.gpu.product}"
        elif min_memory and node.gpu_memory and node.gpu_memory < min_memory:
            reason = f"with GPUs under {spec.gpu.min_memory}"
        elif node.free == 0:
            reason = "with all GPUs taken"
        else:
            if not node.gpu_memory and min_memory:
                node = NodeInfo(**{**node.__dict__, "gpu_memory": min_memory})
            out.nodes.append(node)
            continue
        out.excluded[reason] += 1
    return out
