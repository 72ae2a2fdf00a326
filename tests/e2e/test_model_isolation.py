"""A model's pods fenced off from other tenants, on the real local control plane (kwok nodes): one
namespace, one node and one operator process shared by every check of this module.

- Every model gets a NetworkPolicy, owned by it: the rendezvous and collective ports open to its own
  pods only, the serving port to spec.serving.allowFrom and the operator's pods; its pods mount the
  Secret of spec.serving.auth read-only and are told to check the keys.
- A NetworkPolicy of the model's name that is not the model's is not taken over (ObjectConflict).
- A local checkpoint tier on a node directory the operator does not allow is refused in the status,
  naming the allowed roots, and no pod is made; on an allowed root the API server accepts the pods
  with their root init container.
"""
from __future__ import annotations

import json
import os
import secrets

import pytest

from shardwise.crds.schema import CRD_FILE
from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(180)]

OPERATOR_NAMESPACE = "shardwise-ops"
ROOT = "/mnt/nvme/shardwise"


@pytest.fixture(scope="module")
def tenant(cluster, tmp_path_factory):
    """(namespace, kubectl) with a GPU node selected by the namespace's label and the operator running,
    as if in a pod of OPERATOR_NAMESPACE, allowing ROOT for local checkpoint tiers."""
    namespace = f"fence-{secrets.token_hex(3)}"
    cluster.client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    cluster.install_crd(CRD_FILE)
    node = cluster.add_node(f"{namespace}-n0", 8, labels={"shardwise.dev/test": namespace})

    def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, input=input, check=check, namespace=namespace)
    before = os.environ.get("POD_NAMESPACE")
    os.environ["POD_NAMESPACE"] = OPERATOR_NAMESPACE        # read by the operator process at its start
    try:
        with cluster.operator(namespace, tmp_path_factory.mktemp("operator") / "operator.log",
                              "--operator-pod-labels", "app.kubernetes.io/name=shardwise",
                              "--local-checkpoint-root", ROOT):
            if before is None:
                os.environ.pop("POD_NAMESPACE")
            else:
                os.environ["POD_NAMESPACE"] = before
            yield namespace, kubectl
    finally:
        cluster.delete_node(node)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def model(namespace: str, name: str, **spec) -> dict:
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "/models/m", "parameters": 1_000_000_000, "layers": 16, "heads": 16},
                     "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                     "placement": {"nodeSelector": {"shardwise.dev/test": namespace}}, **spec}}


def training(namespace: str, name: str, host_path: str) -> dict:
    return model(namespace, name, workload="training", training={"data": "/data/d.txt", "steps": 10},
                 checkpoint={"claim": "ckpt", "local": {"hostPath": host_path}})


def _get(kubectl, *what: str) -> dict | None:
    out = kubectl("get", *what, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def _pods(kubectl, name: str) -> list[dict]:
    return json.loads(kubectl("get", "pods", "-l", f"shardwise.dev/model={name}", "-o", "json"))["items"]


def test_a_model_gets_its_own_network_policy_and_its_pods_check_api_keys(tenant):
    namespace, kubectl = tenant
    kubectl("apply", "-f", "-", input=json.dumps(model(namespace, "chat", serving={
        "port": 8000, "auth": {"secretRef": {"name": "chat-keys"}},
        "allowFrom": [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]})))
    policy = wait_until(lambda: _get(kubectl, "networkpolicy", "chat"), 60, "chat's NetworkPolicy", interval=0.5)
    uid = _get(kubectl, "sm", "chat")["metadata"]["uid"]
    assert [r["uid"] for r in policy["metadata"]["ownerReferences"]] == [uid]
    own = {"matchLabels": {"shardwise.dev/model": "chat"}}
    assert policy["spec"]["podSelector"] == own
    peers, serving = policy["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": own}]}
    assert serving["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert serving["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "web"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "shardwise"}}}]

    pods = wait_until(lambda: _pods(kubectl, "chat"), 60, "chat's pod", interval=0.5)
    spec = pods[0]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "chat-keys"
    container = spec["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount["readOnly"] is True
    assert container["args"][-2:] == ["--api-key-file", f"{mount['mountPath']}/keys"]


def test_a_network_policy_of_the_models_name_is_not_taken_over(tenant):
    namespace, kubectl = tenant
    theirs = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "open", "namespace": namespace},
              "spec": {"podSelector": {"matchLabels": {"app": "users-web"}}, "policyTypes": ["Ingress"],
                       "ingress": [{}]}}
    kubectl("apply", "-f", "-", input=json.dumps(theirs))
    kubectl("apply", "-f", "-", input=json.dumps(model(namespace, "open")))

    def conflict():
        status = (_get(kubectl, "sm", "open") or {}).get("status") or {}
        applied = {c["type"]: c for c in status.get("conditions") or []}.get("Applied")
        return applied if applied and applied["reason"] == "ObjectConflict" else None
    applied = wait_until(conflict, 60, "the ObjectConflict condition", interval=0.5)
    assert applied["status"] == "False" and f"NetworkPolicy {namespace}/open" in applied["message"]
    kept = _get(kubectl, "networkpolicy", "open")
    assert kept["spec"]["podSelector"] == {"matchLabels": {"app": "users-web"}}
    assert not kept["metadata"].get("ownerReferences")
    assert not _pods(kubectl, "open")


def test_a_local_tier_outside_the_allowed_roots_is_refused_and_makes_no_pod(tenant):
    namespace, kubectl = tenant
    kubectl("apply", "-f", "-", input=json.dumps(training(namespace, "escape", "/etc")))

    def refused():
        status = (_get(kubectl, "sm", "escape") or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None
    status = wait_until(refused, 60, "escape refused", interval=0.5)
    planned = {c["type"]: c for c in status["conditions"]}["Planned"]
    assert planned["reason"] == "InvalidSpec" and f"allowed: {ROOT}" in planned["message"]
    assert "/etc" in planned["message"]

    # an allowed root (spelled loosely): the API server takes the pods and their init container
    kubectl("apply", "-f", "-", input=json.dumps(training(namespace, "fast", ROOT + "/")))
    pods = wait_until(lambda: _pods(kubectl, "fast"), 60, "fast's pods", interval=0.5)
    spec = pods[0]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "local-checkpoint")
    assert volume["hostPath"]["path"] == f"{ROOT}/{namespace}/fast"
    assert spec["initContainers"][0]["securityContext"]["runAsUser"] == 0
    assert spec["securityContext"]["supplementalGroups"] == [10001]
    assert not _pods(kubectl, "escape")
