"""A model on a claim, with nothing but its uri: the operator reads its shape with a probe pod that
mounts the claim (the operator cannot), plans it from what the probe read and serves it.

On local nodes (pods run as processes); the claim is bound to a hostPath volume holding a small
Llama-family model in Hugging Face format.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"


def _corpus() -> str:
    rnd = random.Random(3)
    words = "a small model on a claim answers what it is asked".split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(10)) for _ in range(100))


def test_a_pvc_model_with_no_hints_is_probed_planned_and_ready(cluster, namespace, kubectl, node_factory,
                                                                tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model

    cluster.install_crd(CRD)
    volume = tmp_path / "volume"
    write_tiny_model(volume / "tiny", _corpus(), layers=4, hidden=64, heads=4, kv_heads=2)
    label = {"shardwise.dev/test": namespace}
    node_factory(f"{namespace[-6:]}-pvc-0", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    with cluster.hostpath_claim(namespace, "weights", volume), \
            cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "onclaim"},
              "spec": {"model": {"uri": "pvc://weights/tiny"}, "dtype": "float32",
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        def status() -> dict:
            return json.loads(kubectl("get", "sm", "onclaim", "-o", "json")).get("status", {})

        ready = wait_until(lambda: status() if status().get("phase") == "Ready" else None, 300, "onclaim Ready",
                           interval=1)
        facts = ready["modelFacts"]
        assert facts["uri"] == "pvc://weights/tiny" and facts["facts"]["layers"] == 4, facts
        assert ready["plan"]["placements"][0]["layers"] == "0-3"
        pods = json.loads(kubectl("get", "pods", "-l", "shardwise.dev/model=onclaim", "-o", "json"))["items"]
        live = [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert live == ["onclaim-r0-s0-a1"], f"the probe pod is gone once read: {live}"
