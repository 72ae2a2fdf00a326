"""End to end on the local control plane: the operator makes a serving model's InferencePool
(inference.networking.k8s.io/v1) once the cluster serves that API, and not before. The test
installs a minimal CRD of that group and kind (the real one's schema is the gateway's business):
before it, the model runs as ever and no pool is attempted; after it, within the discovery cache's
seconds, the pool selects exactly the model's stage-0 pods on the serving port, names its endpoint
picker by convention, and is owned by the model (deleted with it)."""
from __future__ import annotations

import json

import pytest

from shardwise.operator.controller.inferencepool import DISCOVERY_SECONDS
from shardwise.operator.decide.actions import STEADY_REQUEUE
from .test_operator import kube, kubeconfig, model, operator, ready, wait  # noqa: F401 - fixtures

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]
POOL_CRD = "inferencepools.inference.networking.k8s.io"
MINIMAL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {
        "name": POOL_CRD,
        # a *.k8s.io group needs it (the real CRD carries the extension's approval)
        "annotations": {"api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api-inference-extension"}},
    "spec": {"group": "inference.networking.k8s.io", "scope": "Namespaced",
             "names": {"plural": "inferencepools", "singular": "inferencepool", "kind": "InferencePool",
                       "listKind": "InferencePoolList"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}


def test_the_pool_is_made_once_the_cluster_serves_the_inference_extension(kube, operator):
    kube.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true")
    ns = kube.ns
    kube.add_nodes([(f"{ns}-a0", f"{ns}-rack-a")])
    try:
        model(kube, "pooled", tensor=1, pipeline=1, replicas=1, serving={"port": 8100})
        wait(ready(kube, "pooled", 1), 90, "pooled Ready")
        # without the API: nothing to make, nothing failed
        assert "InferencePool" not in operator.log.read_text()
        kube.kubectl("apply", "-f", "-", input=json.dumps(MINIMAL_CRD))
        kube.kubectl("wait", "--for=condition=Established", f"crd/{POOL_CRD}", "--timeout=30s")

        def pool():
            found = json.loads(kube.kubectl("get", "inferencepools", "-n", ns, "-o", "json"))["items"]
            return found[0] if found else None
        made = wait(pool, DISCOVERY_SECONDS + STEADY_REQUEUE + 15, "the InferencePool")
        assert made["metadata"]["name"] == "pooled"
        assert made["spec"] == {"selector": {"matchLabels": {"shardwise.dev/model": "pooled", "shardwise.dev/stage": "0"}},
                                "targetPorts": [{"number": 8100}],
                                "endpointPickerRef": {"name": "pooled-epp", "port": {"number": 9002}}}
        uid = kube.model("pooled")["metadata"]["uid"]
        assert [o["uid"] for o in made["metadata"]["ownerReferences"]] == [uid]
        selected = kube.get("pods", selector="shardwise.dev/model=pooled,shardwise.dev/stage=0")["items"]
        assert len(selected) == 1 and selected[0]["spec"]["containers"][0]["ports"][0]["containerPort"] == 8100
        kube.kubectl("delete", "sm", "pooled", "-n", ns)
        wait(lambda: pool() is None, 60, "the pool collected with its model")
    finally:
        kube.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=false", check=False)
