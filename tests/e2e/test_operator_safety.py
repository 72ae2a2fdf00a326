"""The operator against hostile or careless tenants, on the real local control plane (kwok nodes):
one namespace, one node and one operator process shared by every check of this module.

- A ShardedModel named like a Service that is not its own does not take it over: the Service keeps
  its selector and gets no ownerReference (deleting the model would delete it), and the model says
  why in its Applied condition (ObjectConflict).
- A tenant's pod carrying a model's labels is not the model's: tearing the model's group down
  (scaling to 0) deletes the pods the model owns and leaves that one alone.
- Hostile specs each end in a status condition or a plan, never in a stalled operator: a model at
  `/dev/zero` without hints (probed in the operator's image, never read by the operator), 1,024-layer
  hints, and a pending pod of another tenant that claims a node's GPUs by the planned-node
  annotation; meanwhile another model recovers a lost pod as fast as it did before they came.
"""
from __future__ import annotations

import json
import secrets
import time

import pytest

from shardwise.crds.schema import CRD_FILE
from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def tenant(cluster, tmp_path_factory):
    """(namespace, kubectl) with a GPU node selected by the namespace's label and the operator running."""
    namespace = f"safety-{secrets.token_hex(3)}"
    cluster.client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    cluster.install_crd(CRD_FILE)
    node = cluster.add_node(f"{namespace}-n0", 8, labels={"shardwise.dev/test": namespace})

    def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, input=input, check=check, namespace=namespace)
    try:
        with cluster.operator(namespace, tmp_path_factory.mktemp("operator") / "operator.log"):
            yield namespace, kubectl
    finally:
        cluster.delete_node(node)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def model(namespace: str, name: str) -> dict:
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "/models/m", "parameters": 1_000_000_000, "layers": 16, "heads": 16},
                     "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                     "placement": {"nodeSelector": {"shardwise.dev/test": namespace}}}}


def test_a_model_named_like_a_users_service_does_not_take_it_over(tenant):
    namespace, kubectl = tenant
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": namespace},
               "spec": {"selector": {"app": "users-web"}, "ports": [{"port": 80}]}}
    kubectl("apply", "-f", "-", input=json.dumps(service))
    kubectl("apply", "-f", "-", input=json.dumps(model(namespace, "web")))

    def conflict():
        status = json.loads(kubectl("get", "sm", "web", "-o", "json")).get("status") or {}
        applied = {c["type"]: c for c in status.get("conditions") or []}.get("Applied")
        return applied if applied and applied["reason"] == "ObjectConflict" else None
    applied = wait_until(conflict, 60, "the ObjectConflict condition", interval=0.5)
    assert applied["status"] == "False" and f"Service {namespace}/web" in applied["message"]
    svc = json.loads(kubectl("get", "service", "web", "-o", "json"))
    assert svc["spec"]["selector"] == {"app": "users-web"}
    assert not svc["metadata"].get("ownerReferences")


def test_a_pod_with_a_models_labels_is_not_torn_down_with_its_group(tenant):
    namespace, kubectl = tenant
    kubectl("apply", "-f", "-", input=json.dumps(model(namespace, "own")))

    def pods():
        out = json.loads(kubectl("get", "pods", "-l", "shardwise.dev/model=own", "-o", "json"))["items"]
        return {p["metadata"]["name"]: p for p in out if not p["metadata"].get("deletionTimestamp")}
    wait_until(lambda: any(p["metadata"].get("ownerReferences") for p in pods().values()), 60, "own's pod")
    decoy = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "decoy", "namespace": namespace,
                          "labels": {"shardwise.dev/model": "own", "shardwise.dev/replica": "0",
                                     "shardwise.dev/attempt": "0"}},
             "spec": {"nodeSelector": {"shardwise.dev/test": namespace},
                      "containers": [{"name": "c", "image": "tenant/anything:1"}]}}
    kubectl("apply", "-f", "-", input=json.dumps(decoy))
    kubectl("scale", "sm/own", "--replicas", "0")
    wait_until(lambda: set(pods()) == {"decoy"}, 60, "own's pods gone, the decoy kept", interval=0.5)


def _status(kubectl, name: str) -> dict:
    return json.loads(kubectl("get", "sm", name, "-o", "json")).get("status") or {}


def _recovery_seconds(kubectl, name: str) -> float:
    """Seconds from deleting the running pod of the model's one replica, once the model says it is
    Ready, to a new pod (another uid) Running and Ready."""
    def ready_pod():
        out = json.loads(kubectl("get", "pods", "-l", f"shardwise.dev/model={name}", "-o", "json"))["items"]
        for p in out:
            conds = {c["type"]: c["status"] for c in (p.get("status") or {}).get("conditions") or []}
            if not p["metadata"].get("deletionTimestamp") and conds.get("Ready") == "True":
                return p["metadata"]
        return None
    wait_until(lambda: _status(kubectl, name).get("phase") == "Ready", 60, f"{name} Ready", interval=0.2)
    old = wait_until(ready_pod, 60, f"{name}'s pod Ready", interval=0.2)
    started = time.monotonic()
    kubectl("delete", "pod", old["name"], "--wait=false")
    wait_until(lambda: (p := ready_pod()) is not None and p["uid"] != old["uid"], 60,
               f"{name}'s replacement Ready", interval=0.2)
    return time.monotonic() - started


def test_hostile_specs_end_in_conditions_while_another_model_recovers_as_fast(tenant, cluster):
    namespace, kubectl = tenant
    pool = {"shardwise.dev/test-hostile": namespace}
    node = cluster.add_node(f"{namespace}-n1", 8, labels=pool)
    try:
        steady = model(namespace, "steady")
        steady["spec"]["placement"] = {"nodeSelector": pool}
        # recovered at once every time: no backoff growing between the measurements, no give-up
        steady["spec"]["recovery"] = {"maxRestarts": 100, "backoffSeconds": 0}
        kubectl("apply", "-f", "-", input=json.dumps(steady))
        before = min(_recovery_seconds(kubectl, "steady") for _ in range(2))

        # a pending pod of another tenant that says it was planned onto the node with all 8 GPUs
        spoof = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "spoof", "namespace": namespace,
                              "annotations": {"shardwise.dev/planned-node": node}},
                 "spec": {"nodeSelector": {"no-such-label": "x"},
                          "containers": [{"name": "c", "image": "tenant/anything:1",
                                          "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
        zero = model(namespace, "zero")
        zero["spec"]["model"] = {"uri": "/dev/zero"}
        zero["spec"]["image"] = "tenant/evil:1"
        deep = model(namespace, "deep")
        deep["spec"]["model"].update(layers=1024, parameters=10**15)
        wide = model(namespace, "wide")          # needs the node's other GPUs, which the spoof claims
        wide["spec"]["parallelism"]["tensor"] = 4
        for obj in (spoof, zero, deep, wide):
            if obj["kind"] == "ShardedModel":
                obj["spec"]["placement"] = {"nodeSelector": pool}
            kubectl("apply", "-f", "-", input=json.dumps(obj))
        after = min(_recovery_seconds(kubectl, "steady") for _ in range(2))

        # /dev/zero: the operator reads nothing; a probe pod in the operator's image reads it
        def probing():
            groups = _status(kubectl, "zero").get("groups") or []
            return groups and "reading the model's shape from /dev/zero" in (groups[0].get("lastFailure") or "")
        wait_until(probing, 30, "zero waiting for its probe", interval=0.5)
        probes = json.loads(kubectl("get", "pods", "-l", "shardwise.dev/role=model-probe", "-o", "json"))["items"]
        images = {c["image"] for p in probes for c in p["spec"]["containers"]}
        assert probes and "tenant/evil:1" not in images

        # 1,024 layers of 10^15 parameters: refused in a condition, not planned forever
        def refused():
            planned = {c["type"]: c for c in _status(kubectl, "deep").get("conditions") or []}.get("Planned")
            return planned if planned and planned["status"] == "False" else None
        assert wait_until(refused, 30, "deep's Planned condition", interval=0.5)["reason"] == "NoFeasiblePlan"

        # the spoofed annotation holds no GPU: wide is placed on the node
        def wide_on_node():
            pods = json.loads(kubectl("get", "pods", "-l", "shardwise.dev/model=wide", "-o", "json"))["items"]
            return any(p["spec"].get("nodeName") == node for p in pods)
        wait_until(wide_on_node, 60, "wide's pod on the node the spoof claims", interval=0.5)

        assert after <= 2 * before + 3, f"steady recovered in {after:.1f} s beside hostile models, {before:.1f} s before"
        print(f"steady's recovery: {before:.2f} s alone, {after:.2f} s beside the hostile models")
    finally:
        for name in ("steady", "zero", "deep", "wide"):
            kubectl("delete", "sm", name, "--wait=false", check=False)
        kubectl("delete", "pod", "spoof", "--wait=false", check=False)
        cluster.delete_node(node)
