"""Node inventory from `kubectl get nodes,pods -o yaml`: free GPUs, topology, what a spec may use."""
from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes import client as k8s

from shardwise.operator.cli import plan as plan_cmd
from shardwise.crds.models import ShardedModelSpec
from shardwise.operator.planning import inventory

ROOT = Path(__file__).resolve().parents[2]


def spec(**extra) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({"model": {"uri": "/m"}, **extra})


def gpu_pod(node: str, gpus: int, phase: str = "Running", labels: dict | None = None, init: int = 0) -> dict:
    pod = {"kind": "Pod", "metadata": {"name": f"p-{node}-{gpus}", "namespace": "default", "labels": labels or {}},
           "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
           "status": {"phase": phase}}
    if init:
        pod["spec"]["initContainers"] = [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": str(init)}}}]
    return pod


def test_example_nodes_file_reads_with_labels_memory_and_health():
    nodes, pods = inventory.load(ROOT / "examples" / "nodes.yaml")
    infos = {i.name: i for i in inventory.build(nodes, pods)}
    assert len(infos) == 12
    a11 = infos["gpu-a1-1"]
    assert (a11.gpus, a11.free, a11.gpu_memory, a11.product) == (8, 8, 81559 * 2**20, "NVIDIA-H100-80GB-HBM3")
    assert a11.labels["topology.shardwise.dev/rack"] == "rack-a1"
    assert infos["gpu-a1-3"].unschedulable and not infos["gpu-b2-3"].ready
    usable = inventory.usable(infos.values(), spec())
    assert len(usable.nodes) == 9
    assert usable.why_not() == "1 cordoned, 1 tainted dedicated:NoSchedule, 1 NotReady"


def test_gpus_held_by_live_pods_are_taken_and_finished_pods_free_them():
    nodes, _ = inventory.load(ROOT / "examples" / "nodes.yaml")
    pods = [gpu_pod("gpu-a1-1", 4), gpu_pod("gpu-a1-1", 2), gpu_pod("gpu-a1-2", 8, phase="Succeeded"),
            gpu_pod("gpu-a2-1", 1, init=3), gpu_pod("unscheduled", 8)]
    pods[-1]["spec"].pop("nodeName")
    infos = {i.name: i for i in inventory.build(nodes, pods)}
    assert infos["gpu-a1-1"].free == 2
    assert infos["gpu-a1-2"].free == 8
    assert infos["gpu-a2-1"].free == 5          # an init container's GPUs count while it is the larger
    own = {"shardwise.dev/model": "mine"}
    mine = [gpu_pod("gpu-b1-1", 8, labels=own)]
    ignored = inventory.build(nodes, mine, ignore_pod=lambda p: p["metadata"]["labels"] == own)
    assert {i.name: i for i in ignored}["gpu-b1-1"].free == 8


def test_a_node_list_with_pods_in_one_file(tmp_path):
    nodes, _ = inventory.load(ROOT / "examples" / "nodes.yaml")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": nodes[:2] + [gpu_pod("gpu-a1-1", 3)]}))
    nodes2, pods2 = inventory.load(path)
    assert len(nodes2) == 2 and len(pods2) == 1
    assert inventory.build(nodes2, pods2)[0].free == 5


def test_kubernetes_client_objects_are_accepted():
    node = k8s.V1Node(metadata=k8s.V1ObjectMeta(name="n1", labels={"nvidia.com/gpu.memory": "40960"}),
                      spec=k8s.V1NodeSpec(taints=[k8s.V1Taint(key="gpu", value="a100", effect="NoSchedule")]),
                      status=k8s.V1NodeStatus(allocatable={"nvidia.com/gpu": "4"},
                                              conditions=[k8s.V1NodeCondition(type="Ready", status="True")]))
    pod = k8s.V1Pod(spec=k8s.V1PodSpec(node_name="n1", containers=[k8s.V1Container(
        name="c", resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}))]),
        status=k8s.V1PodStatus(phase="Pending"))
    [info] = inventory.build(plan_cmd.as_dicts([node]), plan_cmd.as_dicts([pod]))   # what --from-cluster does
    assert (info.gpus, info.free, info.gpu_memory) == (4, 3, 40 * 2**30)
    assert info.taints == (inventory.Taint("gpu", "a100", "NoSchedule"),)


def test_tolerations_match_like_the_scheduler():
    taint = inventory.Taint("gpu", "a100", "NoSchedule")
    tol = lambda **t: spec(placement={"tolerations": [t]}).placement.tolerations  # noqa: E731
    assert inventory.tolerated(taint, tol(key="gpu", operator="Equal", value="a100"))
    assert inventory.tolerated(taint, tol(key="gpu", operator="Exists", effect="NoSchedule"))
    assert inventory.tolerated(taint, tol(operator="Exists"))            # empty key tolerates every taint
    assert not inventory.tolerated(taint, tol(key="gpu", operator="Equal", value="h100"))
    assert not inventory.tolerated(taint, tol(key="gpu", operator="Exists", effect="NoExecute"))
    assert inventory.tolerated(inventory.Taint("soft", "", "PreferNoSchedule"), [])


def test_selector_product_memory_and_resource_name_filters():
    nodes, _ = inventory.load(ROOT / "examples" / "nodes.yaml")
    infos = inventory.build(nodes)
    picky = spec(placement={"nodeSelector": {"topology.kubernetes.io/zone": "zone-b"}},
                 gpu={"product": "NVIDIA-H100-80GB-HBM3", "minMemory": "80G"})  # 81559 MiB < 80Gi
    usable = inventory.usable(infos, picky)
    assert {n.labels["topology.kubernetes.io/zone"] for n in usable.nodes} == {"zone-b"}
    assert "5 not matching nodeSelector" in usable.why_not()  # zone-a, less the cordoned one
    assert inventory.usable(infos, spec(gpu={"minMemory": "96Gi"})).nodes == []
    amd = spec(gpu={"resourceName": "amd.com/gpu"})
    none = inventory.usable(inventory.build(nodes, resource_name=amd.gpu.resource_name), amd)
    assert none.nodes == [] and "9 without amd.com/gpu" in none.why_not()


def test_only_bound_pods_and_the_operators_own_pending_pods_hold_gpus():
    from shardwise.crds import names
    from shardwise.operator.planning.inventory import counted_node

    def pod(labels=None, annotations=None, owners=None, node=None):
        return {"metadata": {"name": "p", "namespace": "t", "labels": labels or {}, "annotations": annotations or {},
                             "ownerReferences": owners or []},
                "spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
                "status": {"phase": "Pending"}}
    planned = {names.ANNOTATION_PLANNED_NODE: "n1"}
    ours = [{"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "name": "m", "uid": "u",
             "controller": True}]
    # a tenant's pending pod claiming a planned node holds nothing, labelled like ours or not
    assert counted_node(pod(annotations=planned)) is None
    assert counted_node(pod(labels={names.LABEL_MODEL: "m"}, annotations=planned)) is None
    assert counted_node(pod(labels={names.LABEL_MODEL: "other"}, annotations=planned, owners=ours)) is None
    # the operator's own pending pod holds its planned node; any pod bound by the scheduler its node
    assert counted_node(pod(labels={names.LABEL_MODEL: "m"}, annotations=planned, owners=ours)) == "n1"
    assert counted_node(pod(annotations=planned, node="n2")) == "n2"


def test_a_tenants_bound_pod_with_a_models_labels_still_holds_its_gpus_when_that_model_replans():
    import pytest

    from shardwise.crds import names
    from shardwise.crds.models import ShardedModelSpec
    from shardwise.crds.modelshape import from_hints
    from shardwise.operator.planning import groups
    from tests.operator.builders import k8s_node

    spec = ShardedModelSpec.model_validate({"model": {"uri": "/m", "parameters": 10**9, "layers": 8, "heads": 8},
                                            "parallelism": {"tensor": 8, "pipeline": 1, "replicas": 1}})
    squatter = {"metadata": {"name": "x", "namespace": "t", "labels": {names.LABEL_MODEL: "m",
                                                                       names.LABEL_REPLICA: "0"}},
                "spec": {"nodeName": "n0", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
                "status": {"phase": "Running"}}
    with pytest.raises(groups.ShortOfCapacity):
        groups.plan_groups(spec, from_hints(spec.model), "t", "m", {"n0": k8s_node("n0")}, [squatter], [0],
                           None, [])
