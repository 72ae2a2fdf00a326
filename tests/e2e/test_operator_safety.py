"""The operator against hostile or careless tenants, on the real local control plane (kwok nodes):
one namespace, one node and one operator process shared by every check of this module.

- A ShardedModel named like a Service that is not its own does not take it over: the Service keeps
  its selector and gets no ownerReference (deleting the model would delete it), and the model says
  why in its Applied condition (ObjectConflict).
- A tenant's pod carrying a model's labels is not the model's: tearing the model's group down
  (scaling to 0) deletes the pods the model owns and leaves that one alone.
"""
from __future__ import annotations

import json
import secrets

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
