"""A training job whose shared checkpoint tier is an object store, on local nodes (pods run as
processes): `checkpoint.uri: s3://checkpoints/tiny` on a real S3 server (MinIO on loopback) with the
endpoint, path-style addressing and a Secret of credentials, and no claim and no local tier, so the
store holds the only copy of every checkpoint.

Two nodes of one "GPU", 2 replicas that accept 1 (training.minReplicas). The node of replica 1 is
lost: the operator re-plans the job on the node left at data-parallel degree 1, whose new pod (a new
emptyDir at checkpoint.path) resumes from the store, resharded from DP=2. The job ends Succeeded with
every step, the store holds its last two checkpoints, and the loss of every step matches an
uninterrupted `shardwise train` run of the same global batch within 1e-3.

The reference is that one-process run, started with the job (tests/e2e/test_elastic_training.py's
Reference): it costs a few seconds of one core that overlap the job's waits, where a second job
would double the test.

Heavy (torch ranks on CPU, a node-loss cycle): marked `slow`.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from shardwise.e2e.pytest_plugin import wait_until
from tests.e2e.test_elastic_training import Reference, _steps
from tests.e2e.test_training_job import Job, _corpus

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
BUCKET, PREFIX = "checkpoints", "tiny"
# As in test_training_job.py: on a fast machine ~75 steps are done by the time the test sees the first
# checkpoint in the status and stops a node, so the run must be longer than that (the node loss
# stops it at once: rank 0's next collective loses its peer). The learning rate is one at which runs
# of different data-parallel degrees stay within 1e-3 (see test_elastic_training.py).
STEPS, EVERY, KEEP = 160, 20, 2
OPTIONS = {"batchSize": 4, "seqLength": 32, "learningRate": 0.001, "seed": 7}
RTOL = 1e-3


def _store_steps(client) -> dict[int, list[str]]:
    """step -> the object names under the step's prefix, for every step whose COMPLETE marker exists."""
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/").get("Contents", [])
    keys = [o["Key"][len(PREFIX) + 1:] for o in listed]
    committed = {k.split("/")[0] for k in keys if k.endswith("/COMPLETE")}
    return {int(d.split("-")[1]): sorted(k for k in keys if k.startswith(d + "/")) for d in committed}


@pytest.fixture
def s3_job(cluster, namespace, kubectl, node_factory, tmp_path):
    """MinIO with the bucket, the credentials Secret, two local nodes, the operator and the job;
    yields (Job, nodes, a boto3 client of the store, the reference run)."""
    pytest.importorskip("torch")
    from shardwise.e2e import s3server
    from shardwise.worker.fetch.s3 import S3Config, make_client
    from shardwise.worker.training.s3_storage import prepare_client
    from shardwise.worker.weights.tiny import write_tiny_model

    if not os.access(s3server.minio_path(), os.X_OK):
        pytest.skip("the S3 server is not built: python -m shardwise.e2e.s3server")
    if cluster.state_dir is None:
        pytest.skip("the losses are read from the pods' logs, which only a cluster of this machine has")
    cluster.install_crd(CRD)
    model = write_tiny_model(tmp_path / "model", _corpus(), layers=4, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "corpus.txt").write_text(_corpus())
    label = {"shardwise.dev/test": namespace}
    nodes = [node_factory(f"{namespace[-6:]}-s3c-{i}", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
             for i in range(2)]
    with s3server.running_s3_server(tmp_path / "minio") as store:
        client = prepare_client(make_client(S3Config(endpoint=store.endpoint, path_style=True), store.env()))
        client.create_bucket(Bucket=BUCKET)
        kubectl("create", "secret", "generic", "checkpoint-store",
                f"--from-literal=AWS_ACCESS_KEY_ID={store.access_key}",
                f"--from-literal=AWS_SECRET_ACCESS_KEY={store.secret_key}")
        reference = Reference(model, tmp_path / "corpus.txt", tmp_path, STEPS, OPTIONS)
        try:
            with cluster.operator(namespace, tmp_path / "operator.log"):
                sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
                      "metadata": {"name": "tiny-train"},
                      "spec": {"model": {"uri": str(model)}, "workload": "training", "dtype": "float32",
                               "training": {"data": str(tmp_path / "corpus.txt"), "steps": STEPS,
                                            "minReplicas": 1, **OPTIONS},
                               "checkpoint": {"uri": f"s3://{BUCKET}/{PREFIX}", "endpoint": store.endpoint,
                                              "pathStyle": True, "credentialsRef": {"name": "checkpoint-store"},
                                              "path": "/checkpoints/tiny", "intervalSteps": EVERY, "keep": KEEP},
                               "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                               "placement": {"nodeSelector": label},
                               "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
                kubectl("apply", "-f", "-", input=json.dumps(sm))
                yield Job(cluster, namespace, kubectl, tmp_path), nodes, client, reference
        finally:
            reference.stop()


def _wait(job: Job, predicate, timeout: float, what: str) -> dict:
    """wait_until on the job's status; a timeout names the last status and the job's Events."""
    try:
        return wait_until(lambda: (s := job.status()) and predicate(s) and s, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\nstatus: {json.dumps(job.status())[:3000]}\nevents: {job.events()}") from None


def test_a_job_checkpointing_to_s3_survives_a_node_loss_resumes_from_the_store_resharded(s3_job, cluster):
    job, nodes, client, reference = s3_job
    t0 = time.monotonic()
    first = _wait(job, lambda s: s.get("phase") == "Running" and s.get("replicas") == 2 and
                  (s.get("lastCheckpoint") or {}).get("step", 0) >= EVERY, 180,
                  "the job Running on 2 replicas with a first checkpoint in the store")
    print(f"created -> Running x2 with checkpoint step {first['lastCheckpoint']['step']} in {time.monotonic() - t0:.1f}s")
    assert first["lastCheckpoint"]["step"] in _store_steps(client)

    # Lose the node of replica 1: the job is re-planned on the node left, at one replica.
    lost = next(p["node"] for p in first["plan"]["placements"] if p["replica"] == 1)
    t0 = time.monotonic()
    cluster.node_down(lost)
    done = _wait(job, lambda s: s.get("phase") in ("Succeeded", "Failed"), 300, "the job to finish")
    print(f"node down -> {done['phase']} in {time.monotonic() - t0:.1f}s, restarts {done.get('restarts')}")
    assert done["phase"] == "Succeeded", done.get("message")
    assert done["replicas"] == 1 and [p["node"] for p in done["plan"]["placements"]] == [n for n in nodes if n != lost]
    assert done["restarts"] >= 1, "\n".join(job.events())
    assert done["training"]["step"] == STEPS and done["lastCheckpoint"]["step"] == STEPS

    # The new world read its checkpoint from the store (its pod is new: an empty checkpoint.path, no
    # claim, no local tier), saved under DP=2 and loaded under DP=1.
    attempt = done["groups"][0]["attempt"]
    text = job.pod_log(f"tiny-train-r0-s0-a{attempt}")
    resumed = re.search(r"resumed from checkpoint step (\d+) \(saved under TP=1 PP=1 DP=2, now TP=1 PP=1 DP=1\) "
                        rf"in s3://{BUCKET}/{PREFIX}", text)
    assert resumed, text[-2000:]
    step = int(resumed.group(1))
    assert first["lastCheckpoint"]["step"] <= step < STEPS and step % EVERY == 0
    print(f"resumed at DP=1 from checkpoint step {step} in s3://{BUCKET}/{PREFIX}")
    pods = sorted((Path(cluster.state_dir) / "pods").glob(f"{job.namespace}_tiny-train-r*"))
    on_disk = [p.name for pod in pods for p in (pod / "volumes" / "checkpoint").iterdir()]
    assert len(pods) >= 3 and set(on_disk) <= {"progress.json"}, on_disk   # no pod had a copy of its own

    # The store holds the last KEEP checkpoints, each with its marker and the ranks' DCP files.
    stored = _store_steps(client)
    assert sorted(stored) == [STEPS - EVERY * i for i in reversed(range(KEEP))], stored
    last = stored[STEPS]
    assert any(k.endswith("/.metadata") for k in last) and any(k.endswith(".distcp") for k in last), last
    print(f"store: {sorted(stored)}, step {STEPS}: {len(last)} objects")

    # Every step's loss (the last value rank 0 logged for it, over every run) is the uninterrupted run's.
    got: dict[int, float] = {}
    for run in sorted((Path(cluster.state_dir) / "pods").glob(f"{job.namespace}_tiny-train-r0-s0-a*"),
                      key=lambda p: int(p.name.rsplit("-a", 1)[1])):
        got.update(_steps((run / "worker.log").read_text(errors="replace")))
    want = reference.losses()
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps missing: {sorted(set(range(1, STEPS + 1)) - set(got))[:10]}"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    after = max(abs(got[s] - want[s]) / abs(want[s]) for s in want if s > step)
    print(f"largest relative loss difference: {worst:.2e} over {STEPS} steps, {after:.2e} after the resume")
    bad = [(s, got[s], want[s]) for s in sorted(want) if abs(got[s] - want[s]) > RTOL * abs(want[s])]
    assert not bad, f"steps whose loss differs from the uninterrupted run: {bad[:5]}"
