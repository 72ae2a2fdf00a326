"""Training ShardedModels on local nodes (pods run as processes): the operator starts the real
worker in training mode over data-parallel replicas on a shared checkpoint claim and reports the
job's progress and last checkpoint in the status.

- A node is lost mid-run: the whole job (both replicas: one torch.distributed world) restarts on
  the nodes left, resumes from the last complete checkpoint, and ends Succeeded with every step.
- A running job is scaled from one replica to two: it restarts whole (nothing failed, no restart
  counted) and resumes its checkpoint under the new data-parallel degree.

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
# Steps of 25-250 ms on two CPU cores: by the time the test sees the first checkpoint (step 20) in
# the status and acts (a node loss, a scale), a fast machine has done ~75 steps; the rest of the run
# outlasts that with room to spare, and each run after a restart still commits the two checkpoints
# the job keeps.
STEPS, EVERY = 200, 20


def _corpus() -> str:
    rnd = random.Random(1)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly brew elixirs".split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300))


class Job:
    """One training ShardedModel `tiny-train` in the test's namespace, and what the test reads of it."""

    def __init__(self, cluster, namespace: str, kubectl, tmp_path: Path):
        self.cluster, self.namespace, self.kubectl = cluster, namespace, kubectl
        self.volume = tmp_path / "volume"

    def status(self) -> dict:
        return json.loads(self.kubectl("get", "sm", "tiny-train", "-o", "json")).get("status", {})

    def events(self) -> list[str]:
        items = json.loads(self.kubectl("get", "events", "--field-selector", "involvedObject.name=tiny-train",
                                        "-o", "json"))["items"]
        return [f"{e['reason']}: {e['message']}" for e in sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])]

    def pod_log(self, pod: str) -> str:
        if self.cluster.state_dir is None:     # a cluster of its own (SHARDWISE_KUBECONFIG): no local logs
            return ""
        path = Path(self.cluster.state_dir) / "pods" / f"{self.namespace}_{pod}" / "worker.log"
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture
def training_job(cluster, namespace, kubectl, node_factory, tmp_path):
    """Three local nodes of one "GPU" in one rack, the checkpoint claim, the operator; yields a
    function that applies the job with a given replica count and returns a Job."""
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model

    cluster.install_crd(CRD)
    model = write_tiny_model(tmp_path / "model", _corpus(), layers=4, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "corpus.txt").write_text(_corpus())
    label = {"shardwise.dev/test": namespace}
    for i in range(3):
        node_factory(f"{namespace[-6:]}-train-{i}", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    # The checkpoint claim every pod mounts: bound by the persistent-volume controller to a hostPath
    # volume, a folder of this machine that all local pods share (as a ReadWriteMany volume is).
    with cluster.hostpath_claim(namespace, "checkpoints", tmp_path / "volume"), \
            cluster.operator(namespace, tmp_path / "operator.log"):
        def apply(replicas: int) -> Job:
            sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "tiny-train"},
                  "spec": {"model": {"uri": str(model)}, "workload": "training", "dtype": "float32",
                           "training": {"data": str(tmp_path / "corpus.txt"), "steps": STEPS, "batchSize": 4,
                                        "seqLength": 32, "learningRate": 0.003, "seed": 7},
                           "checkpoint": {"claim": "checkpoints", "path": "/checkpoints/tiny",
                                          "intervalSteps": EVERY, "keep": 2},
                           "parallelism": {"tensor": 1, "pipeline": 1, "replicas": replicas},
                           "placement": {"nodeSelector": label},
                           "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
            kubectl("apply", "-f", "-", input=json.dumps(sm))
            return Job(cluster, namespace, kubectl, tmp_path)
        yield apply


def test_training_job_survives_a_node_loss_resumes_from_its_checkpoint_and_succeeds(training_job, cluster):
    job = training_job(replicas=2)

    # Running, with the progress and the last checkpoint read from the job while it trains.
    t0 = time.monotonic()
    first = wait_until(lambda: (s := job.status()).get("phase") == "Running" and
                       (s.get("lastCheckpoint") or {}).get("step", 0) >= EVERY and s, 300,
                       "the job Running with a first checkpoint in its status")
    print(f"created -> Running with checkpoint step {first['lastCheckpoint']['step']} "
          f"in {time.monotonic() - t0:.1f}s")
    assert first["training"]["steps"] == STEPS and 0 < first["training"]["step"] <= STEPS
    assert first["lastCheckpoint"]["path"].startswith("/checkpoints/tiny/step-")
    assert first.get("endpoint") is None and first["replicas"] == 2
    wide = job.kubectl("get", "sm", "tiny-train", "-o", "wide")
    assert "STEP" in wide and "CHECKPOINT" in wide
    services = json.loads(job.kubectl("get", "svc", "-o", "json"))["items"]
    assert [s["spec"]["clusterIP"] for s in services] == ["None"]   # the rendezvous one; nothing to serve

    # Lose the node of replica 1: replica 0 cannot go on without it, so the whole job restarts.
    placements = {p["replica"]: p["node"] for p in first["plan"]["placements"]}
    lost = placements[1]
    attempt = first["groups"][0]["attempt"]
    t0 = time.monotonic()
    cluster.node_down(lost)
    wait_until(lambda: job.status().get("restarts", 0) >= 1, 120, "the job to be torn down")
    restarted = wait_until(lambda: (s := job.status()).get("phase") == "Running" and
                           s["groups"][0]["attempt"] > attempt and s, 300, "the job Running again")
    print(f"node down -> Running again in {time.monotonic() - t0:.1f}s")
    assert lost not in {p["node"] for p in restarted["plan"]["placements"]}
    assert {g["attempt"] for g in restarted["groups"]} == {restarted["groups"][0]["attempt"]}
    # One restart of the job per teardown, not one per replica. (A second can happen when the job
    # is re-planned in the seconds before the lost node is marked NotReady.)
    teardowns = [e for e in job.events() if e.startswith("Recovering: training job: ")]
    assert restarted["restarts"] == len(teardowns) >= 1, "\n".join(job.events())
    assert {g["restarts"] for g in restarted["groups"]} == {restarted["restarts"]}

    done = wait_until(lambda: (s := job.status()).get("phase") in ("Succeeded", "Failed") and s, 420,
                      "the job to finish")
    assert done["phase"] == "Succeeded", done.get("message")
    print(f"node down -> Succeeded in {time.monotonic() - t0:.1f}s, restarts {done['restarts']}, "
          f"last checkpoint {done['lastCheckpoint']}")
    assert done["training"]["step"] == STEPS and done["lastCheckpoint"]["step"] == STEPS
    assert {g["phase"] for g in done["groups"]} == {"Succeeded"}
    told = job.events()
    assert any(e.startswith("Recovering: training job: ") for e in told) and "Succeeded" in str(told), "\n".join(told)

    # The new world resumed from the last complete checkpoint: no step before it was redone.
    rank0 = f"tiny-train-r0-s0-a{done['groups'][0]['attempt']}"
    text = job.pod_log(rank0)
    if text:
        resumed = re.search(r"resumed from checkpoint step (\d+)", text)
        assert resumed, text[-2000:]
        # the local node writes the pod's stdout and stderr to one file, so another line can follow a
        # step's record before its newline: take the record that starts the line
        decode = json.JSONDecoder().raw_decode
        steps = [decode(line)[0]["step"] for line in text.splitlines() if line.startswith('{"step"')]
        assert steps[0] == int(resumed.group(1)) + 1 and steps[-1] == STEPS
        assert int(resumed.group(1)) >= first["lastCheckpoint"]["step"]
    committed = sorted(p.name for p in job.volume.glob("step-*"))
    assert committed[-1] == f"step-{STEPS:08d}" and len(committed) == 2   # keep: 2


def test_scaling_a_running_training_job_restarts_it_whole_and_zero_replicas_pause_it(training_job):
    job = training_job(replicas=1)
    t0 = time.monotonic()
    first = wait_until(lambda: (s := job.status()).get("phase") == "Running" and
                       (s.get("lastCheckpoint") or {}).get("step", 0) >= EVERY and s, 300,
                       "the job Running with a first checkpoint")
    # One replica to two: the world changes shape, so the job restarts whole (nothing failed: no
    # restart counted) and resumes its checkpoint under the new data-parallel degree.
    print(f"created -> Running with checkpoint step {first['lastCheckpoint']['step']} in {time.monotonic() - t0:.1f}s")
    t0 = time.monotonic()
    job.kubectl("scale", "sm/tiny-train", "--replicas=2")
    again = wait_until(lambda: (s := job.status()).get("phase") == "Running" and s.get("replicas") == 2 and s,
                       300, "the job Running with two replicas")
    print(f"scaled to 2 -> Running x2 in {time.monotonic() - t0:.1f}s at step {again['training']['step']}")
    assert {g["attempt"] for g in again["groups"]} == {first["groups"][0]["attempt"] + 1}
    assert again["restarts"] == 0, "\n".join(job.events())
    assert any(e.startswith("Restarting: replicas changed from 1 to 2") for e in job.events()), job.events()
    text = job.pod_log(f"tiny-train-r0-s0-a{again['groups'][0]['attempt']}")
    if text:
        resumed = re.search(r"resumed from checkpoint step (\d+) \(saved under TP=1 PP=1 DP=1, now TP=1 PP=1 DP=2\)",
                            text)
        assert resumed and int(resumed.group(1)) >= first["lastCheckpoint"]["step"], text[-2000:]

    # Zero replicas pause it: no pods, phase Pending; scaled up again it goes on to the end.
    t0 = time.monotonic()
    job.kubectl("scale", "sm/tiny-train", "--replicas=0")
    paused = wait_until(lambda: (s := job.status()).get("phase") == "Pending" and
                        not job.kubectl("get", "pods", "-l", "shardwise.dev/model=tiny-train", "-o", "name").strip()
                        and s, 120, "the job paused")
    assert "paused" in paused["message"]
    print(f"scaled to 0 -> paused in {time.monotonic() - t0:.1f}s at step {paused['lastCheckpoint']['step']}")
    t0 = time.monotonic()
    job.kubectl("scale", "sm/tiny-train", "--replicas=2")
    done = wait_until(lambda: (s := job.status()).get("phase") in ("Succeeded", "Failed") and s, 420,
                      "the job to finish")
    assert done["phase"] == "Succeeded" and done["lastCheckpoint"]["step"] == STEPS, done.get("message")
    print(f"scaled to 2 -> Succeeded in {time.monotonic() - t0:.1f}s")
    assert done["restarts"] == 0 and done["lastCheckpoint"]["step"] >= paused["lastCheckpoint"]["step"]
