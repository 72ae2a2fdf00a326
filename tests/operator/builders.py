"""Nodes for the operator's tests: a Kubernetes Node as the API server returns it (what the
reconciler, the recovery rules and planning.groups read), and a NodeInfo (what the planner reads)."""
from __future__ import annotations

from shardwise.crds.names import RACK_LABEL, ZONE_LABEL
from shardwise.operator.planning.inventory import NodeInfo
from shardwise.operator.planning.layouts import GiB

ZONE, RACK = ZONE_LABEL, RACK_LABEL


def k8s_node(name: str, rack: str = "a", gpus: int = 8, ready: bool = True) -> dict:
    """A Node with `gpus` allocatable GPUs in rack `rack` of zone "z"."""
    return {"metadata": {"name": name, "labels": {RACK: rack, ZONE: "z", "kubernetes.io/hostname": name}},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def gpu_node(name: str, free: int, zone: str = "z1", rack: str = "r1", gpus: int = 8, memory_gib: float = 80,
             **kw) -> NodeInfo:
    """A NodeInfo with `free` of its `gpus` GPUs free, each of `memory_gib` GiB."""
    return NodeInfo(name, {ZONE: zone, RACK: rack}, gpus=gpus, used=gpus - free,
                    gpu_memory=int(memory_gib * GiB), **kw)
