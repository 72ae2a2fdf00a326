"""End to end on kind: real kubelets and containerd in Docker containers, every image built here.

What `shardwise kind build` and `shardwise kind up` make (the README's "On a real cluster" block):
a 1 + 4 node cluster from our node image, the chart installed with the operator image, and the
SmolLM2 demo ShardedModel run by the worker image:
- its tensor x pipeline ranks run in pods on different kind nodes (gloo over the pod network) and
  answer a completion through the Service;
- `docker stop` of the node holding a stage: the operator re-plans on the nodes left and the model
  answers again, with the same greedy text;
- a training ShardedModel on a shared claim survives `docker stop` of a node: the job restarts on
  the nodes left, resumes from its last checkpoint and ends Succeeded;
- `helm upgrade` of the chart keeps the ShardedModel and its pods.
The operator and every worker pod run in namespaces that enforce Pod Security `restricted`.

Needs Docker (`shardwise kind docker`); without it the suite is skipped, unless SHARDWISE_REQUIRE_KIND
is set (CI), when it fails instead.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardwise.e2e import build

from shardwise.e2e.kind import images

from shardwise.e2e.kind import registry
from shardwise.e2e.kind.docker import DockerError, check_daemon
from shardwise.e2e.kind.cluster import KindCluster
from shardwise.e2e.pytest_plugin import wait_until
from shardwise.e2e.readme import console_commands

pytestmark = [pytest.mark.kind, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
DEMO = ROOT / "examples" / "smollm2-demo.yaml"
MODEL = "smollm2-demo"
OPERATOR_NS = "shardwise-system"
MODEL_NS = "default"
CLUSTER = "shardwise-e2e"
README = ROOT / "README.md"
PSA = "pod-security.kubernetes.io/enforce"


def say(line: str) -> None:
    print(line, flush=True)


@pytest.fixture(scope="module")
def kind_cluster():
    """The README's "On a real cluster" block, run as typed (one bash script, from the repository
    root) against a cluster of the suite's own name; deleted afterwards unless SHARDWISE_KEEP_KIND."""
    try:
        check_daemon()
    except DockerError as e:
        if os.environ.get("SHARDWISE_REQUIRE_KIND"):
            raise
        pytest.skip(str(e))
    cluster = KindCluster(CLUSTER)
    if cluster.exists():
        cluster.delete()
    commands = console_commands(README.read_text(), "On a real cluster")
    log = build.cache_root() / "kind" / "readme-walk.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SHARDWISE_KIND_CLUSTER": CLUSTER,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)], cwd=ROOT,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3000)
    tail = "\n".join(log.read_text().splitlines()[-40:])
    try:
        assert proc.returncode == 0, f"the README's kind block failed (exit {proc.returncode}):\n{tail}"
        say(f"the README's kind block ran in {time.monotonic() - start:.0f}s:\n{tail}")
        yield cluster
    finally:
        if not os.environ.get("SHARDWISE_KEEP_KIND"):
            cluster.delete()


def _chart_values() -> list[str]:
    """The image values of the README's `helm install`."""
    names = images.product_images("dev")
    repository, tag = f"{registry.PREFIX}/{names.operator}".rsplit(":", 1)
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", f"operator.workerImage={registry.PREFIX}/{names.worker}"]


def model(cluster: KindCluster) -> dict:
    return cluster.get("sm", MODEL, MODEL_NS)


def phase(cluster: KindCluster) -> str:
    cluster.check_pulls(MODEL_NS)   # a full disk fails the test now, not at the end of a long wait
    return (model(cluster).get("status") or {}).get("phase", "")


def ready_pods(cluster: KindCluster) -> list[dict]:
    return cluster.ready_pods(MODEL_NS, f"shardwise.dev/model={MODEL}")


def complete(cluster: KindCluster) -> str:
    return cluster.complete(MODEL_NS, MODEL, "The capital of France is")


def test_the_operator_and_workers_run_under_pod_security_restricted(kind_cluster):
    cluster = kind_cluster
    for ns in (OPERATOR_NS, MODEL_NS):
        labels = cluster.get("namespace", ns, ns)["metadata"]["labels"]
        assert labels.get(PSA) == "restricted", (ns, labels)
    assert cluster.ready_pods(OPERATOR_NS, "app.kubernetes.io/name=shardwise")
    assert phase(cluster) == "Ready" and ready_pods(cluster)   # admitted, and running


def test_sharded_model_spans_nodes_answers_and_recovers_from_a_node_stop(kind_cluster):
    cluster = kind_cluster
    wait_until(lambda: phase(cluster) == "Ready", 600, f"{MODEL} Ready", interval=5,
               retry_on=(DockerError,))
    pods = ready_pods(cluster)
    spec = yaml.safe_load(DEMO.read_text())["spec"]["parallelism"]
    assert len(pods) == spec["pipeline"] * spec["replicas"]
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == len(pods), f"the stages share a node: {nodes}"
    before = complete(cluster)
    assert before.strip(), "the model answered with no text"

    victim = next(p["spec"]["nodeName"] for p in pods
                  if p["metadata"]["labels"].get("shardwise.dev/stage") == "1")
    restarts = (model(cluster).get("status") or {}).get("restarts", 0)
    cluster.stop_node(victim)
    stopped = time.monotonic()
    try:
        wait_until(lambda: phase(cluster) != "Ready", 300, f"{MODEL} to notice node {victim} stopped",
                   interval=2, retry_on=(DockerError,))
        wait_until(lambda: phase(cluster) == "Ready" and len(ready_pods(cluster)) == len(pods), 1200,
                   f"{MODEL} Ready again without {victim}", interval=5, retry_on=(DockerError,))
        say(f"{MODEL} Ready again {time.monotonic() - stopped:.0f}s after `docker stop {victim}`")
        assert victim not in {p["spec"]["nodeName"] for p in ready_pods(cluster)}
        assert (model(cluster).get("status") or {}).get("restarts", 0) > restarts
        assert complete(cluster) == before
    finally:
        cluster.start_node(victim)
        wait_until(lambda: victim in cluster.nodes(), 120, f"{victim} back", interval=5,
                   retry_on=(DockerError,))
        cluster.advertise_gpus()


def _corpus() -> str:
    rnd = random.Random(1)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly brew elixirs".split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300))


def _parameters(model: Path) -> int:
    """Parameter count from the safetensors header (the operator cannot read a claim: hints)."""
    raw = (model / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def test_training_job_survives_a_node_stop_and_succeeds_from_its_checkpoint(kind_cluster):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model

    cluster, steps, every = kind_cluster, 2000, 100
    inputs = cluster.shared_claim(MODEL_NS, "inputs", "inputs", read_only=True)
    volume = cluster.shared_claim(MODEL_NS, "checkpoints", "checkpoints")
    model = write_tiny_model(inputs / "model", _corpus(), layers=4, hidden=64, heads=4, kv_heads=2)
    (inputs / "corpus.txt").write_text(_corpus())
    subprocess.run(["chmod", "-R", "a+rX", str(inputs)], check=True)   # the worker is not root
    config = json.loads((model / "config.json").read_text())
    sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
          "metadata": {"name": "tiny-train", "namespace": MODEL_NS},
          "spec": {"model": {"uri": "pvc://inputs/model", "parameters": _parameters(model),
                             "layers": config["num_hidden_layers"], "heads": config["num_attention_heads"],
                             "kvHeads": config["num_key_value_heads"], "hiddenSize": config["hidden_size"],
                             "intermediateSize": config["intermediate_size"], "vocabSize": config["vocab_size"]},
                   "workload": "training", "dtype": "float32",
                   "training": {"data": "pvc://inputs/corpus.txt", "steps": steps, "batchSize": 4,
                                "seqLength": 32, "learningRate": 0.003, "seed": 7},
                   "checkpoint": {"claim": "checkpoints", "path": "/checkpoints/tiny",
                                  "intervalSteps": every, "keep": 2},
                   "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                   "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))

    def status() -> dict:
        cluster.check_pulls(MODEL_NS)
        return json.loads(cluster.kubectl("get", "sm", "tiny-train", "-n", MODEL_NS, "-o", "json")).get("status", {})

    first = wait_until(lambda: (s := status()).get("phase") == "Running"
                       and (s.get("lastCheckpoint") or {}).get("step", 0) >= every and s, 900,
                       "the training job Running with a first checkpoint", interval=2, retry_on=(DockerError,))
    victim = {p["replica"]: p["node"] for p in first["plan"]["placements"]}[1]
    cluster.stop_node(victim)
    stopped = time.monotonic()
    try:
        done = wait_until(lambda: (s := status()).get("phase") in ("Succeeded", "Failed") and s, 1200,
                          "the training job to finish", interval=5, retry_on=(DockerError,))
        say(f"training job {done['phase']} {time.monotonic() - stopped:.0f}s after `docker stop {victim}`")
    finally:
        cluster.start_node(victim)
    assert done["phase"] == "Succeeded", done.get("message")
    assert done["restarts"] >= 1
    assert victim not in {p["node"] for p in done["plan"]["placements"]}
    assert done["training"]["step"] == steps and done["lastCheckpoint"]["step"] == steps
    # The job did not start over: the restarted world resumed from a checkpoint the first one wrote.
    committed = sorted(p.name for p in volume.glob("step-*"))
    assert committed[-1] == f"step-{steps:08d}" and len(committed) == 2, committed   # keep: 2
    logs = cluster.kubectl("logs", "-n", MODEL_NS, f"tiny-train-r0-s0-a{done['groups'][0]['attempt']}")
    resumed = re.search(r"resumed from checkpoint step (\d+)", logs)
    # the log's head: where the run started, and why it skipped a checkpoint if it did
    assert resumed and int(resumed.group(1)) >= first["lastCheckpoint"]["step"], logs[:3000]


def test_helm_upgrade_keeps_every_sharded_model(kind_cluster):
    cluster = kind_cluster
    if not cluster.kubectl("get", "sm", MODEL, "-n", MODEL_NS, "--ignore-not-found", "-o", "name").strip():
        cluster.kubectl("apply", "-n", MODEL_NS, "-f", str(DEMO))
    uid = model(cluster)["metadata"]["uid"]
    # A changed chart: another log level, rolled out by `helm upgrade`.
    cluster.helm("upgrade", "shardwise", str(CHART), "--namespace", OPERATOR_NS, *_chart_values(),
                 "--set", "operator.logLevel=debug", "--wait", "--timeout", "300s")
    assert model(cluster)["metadata"]["uid"] == uid, "the upgrade replaced the ShardedModel"
    crd = json.loads(cluster.kubectl("get", "crd", "shardedmodels.shardwise.dev", "-o", "json"))
    assert not crd["metadata"].get("deletionTimestamp")
    wait_until(lambda: phase(cluster) == "Ready", 1200, f"{MODEL} Ready after the upgrade", interval=5,
               retry_on=(DockerError,))
