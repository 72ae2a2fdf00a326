"""A training ShardedModel on local nodes (pods run as processes): the operator starts the real
worker in training mode over two data-parallel replicas on a shared checkpoint claim, reports the
job's progress and last checkpoint in the status, loses a node mid-run, restarts the whole job
(both replicas: one torch.distributed world) on the nodes left, which resumes from the last complete
checkpoint, and the model ends Succeeded with every step done.

Heavy (torch ranks on CPU, a node-loss cycle): marked `slow`; CI runs it with the rest of the
control-plane suite.
"""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
STEPS, EVERY = 300, 20


def _corpus() -> str:
    rnd = random.Random(1)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly brew elixirs".split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300))


def _pod_log(cluster, namespace: str, pod: str) -> str:
    if cluster.state_dir is None:       # a cluster of its own (SHARDWISE_KUBECONFIG): no local logs
        return ""
    path = Path(cluster.state_dir) / "pods" / f"{namespace}_{pod}" / "worker.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_training_job_survives_a_node_loss_resumes_from_its_checkpoint_and_succeeds(
        cluster, namespace, kubectl, node_factory, tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.tiny import write_tiny_model

    cluster.install_crd(CRD)
    model = write_tiny_model(tmp_path / "model", _corpus(), layers=4, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "corpus.txt").write_text(_corpus())
    label = {"shardwise.dev/test": namespace}
    # Three local nodes of one "GPU" in one rack: one per replica, one to spare.
    for i in range(3):
        node_factory(f"{namespace[-6:]}-train-{i}", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    # The checkpoint claim every pod mounts: bound by the persistent-volume controller to a hostPath
    # volume, a folder of this machine that all local pods share (as a ReadWriteMany volume is).
    with cluster.hostpath_claim(namespace, "checkpoints", tmp_path / "volume"), \
            cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "tiny-train"},
              "spec": {"model": {"uri": str(model)}, "workload": "training", "dtype": "float32",
                       "training": {"data": str(tmp_path / "corpus.txt"), "steps": STEPS, "batchSize": 4,
                                    "seqLength": 32, "learningRate": 0.003, "seed": 7},
                       "checkpoint": {"claim": "checkpoints", "path": "/checkpoints/tiny", "intervalSteps": EVERY,
                                      "keep": 2},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        def status() -> dict:
            return json.loads(kubectl("get", "sm", "tiny-train", "-o", "json")).get("status", {})

        def events() -> list[str]:
            items = json.loads(kubectl("get", "events", "--field-selector", "involvedObject.name=tiny-train",
                                       "-o", "json"))["items"]
            return [f"{e['reason']}: {e['message']}" for e in sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])]

        # Running, with the progress and the last checkpoint read from the job while it trains.
        t0 = time.monotonic()
        first = wait_until(lambda: (s := status()).get("phase") == "Running" and
                           (s.get("lastCheckpoint") or {}).get("step", 0) >= EVERY and s, 300,
                           "the job Running with a first checkpoint in its status")
        print(f"created -> Running with checkpoint step {first['lastCheckpoint']['step']} "
              f"in {time.monotonic() - t0:.1f}s")
        assert first["training"]["steps"] == STEPS and 0 < first["training"]["step"] <= STEPS
        assert first["lastCheckpoint"]["path"].startswith("/checkpoints/tiny/step-")
        assert first.get("endpoint") is None and first["replicas"] == 2
        wide = kubectl("get", "sm", "tiny-train", "-o", "wide")
        assert "STEP" in wide and "CHECKPOINT" in wide
        services = json.loads(kubectl("get", "svc", "-o", "json"))["items"]
        assert [s["spec"]["clusterIP"] for s in services] == ["None"]   # the rendezvous one; nothing to serve

        # Lose the node of replica 1: replica 0 cannot go on without it, so the whole job restarts.
        placements = {p["replica"]: p["node"] for p in first["plan"]["placements"]}
        lost = placements[1]
        attempt = first["groups"][0]["attempt"]
        t0 = time.monotonic()
        cluster.node_down(lost)
        wait_until(lambda: status().get("restarts", 0) >= 1, 120, "the job to be torn down")
        restarted = wait_until(lambda: (s := status()).get("phase") == "Running" and
                               s["groups"][0]["attempt"] > attempt and s, 300, "the job Running again")
        print(f"node down -> Running again in {time.monotonic() - t0:.1f}s")
        assert lost not in {p["node"] for p in restarted["plan"]["placements"]}
        assert {g["attempt"] for g in restarted["groups"]} == {restarted["groups"][0]["attempt"]}
        # One restart of the job per teardown, not one per replica. (A second can happen when the job
        # is re-planned in the seconds before the lost node is marked NotReady.)
        teardowns = [e for e in events() if e.startswith("Recovering: training job: ")]
        assert restarted["restarts"] == len(teardowns) >= 1, "\n".join(events())
        assert {g["restarts"] for g in restarted["groups"]} == {restarted["restarts"]}

        done = wait_until(lambda: (s := status()).get("phase") in ("Succeeded", "Failed") and s, 420,
                          "the job to finish")
        assert done["phase"] == "Succeeded", done.get("message")
        print(f"node down -> Succeeded in {time.monotonic() - t0:.1f}s, restarts {done['restarts']}, "
              f"last checkpoint {done['lastCheckpoint']}")
        assert done["training"]["step"] == STEPS and done["lastCheckpoint"]["step"] == STEPS
        assert {g["phase"] for g in done["groups"]} == {"Succeeded"}
        told = events()
        assert any(e.startswith("Recovering: training job: ") for e in told) and "Succeeded" in str(told), "\n".join(told)

        # The new world resumed from the last complete checkpoint: no step before it was redone.
        rank0 = f"tiny-train-r0-s0-a{done['groups'][0]['attempt']}"
        text = _pod_log(cluster, namespace, rank0)
        if text:
            resumed = re.search(r"resumed from checkpoint step (\d+)", text)
            assert resumed, text[-2000:]
            steps = [json.loads(line)["step"] for line in text.splitlines() if line.startswith('{"step"')]
            assert steps[0] == int(resumed.group(1)) + 1 and steps[-1] == STEPS
            assert int(resumed.group(1)) >= first["lastCheckpoint"]["step"]
        committed = sorted(p.name for p in (tmp_path / "volume").glob("step-*"))
        assert committed[-1] == f"step-{STEPS:08d}" and len(committed) == 2   # keep: 2
