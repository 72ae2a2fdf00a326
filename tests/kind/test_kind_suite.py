"""End to end on kind: real kubelets and containerd in Docker containers, every image built here.

What `shardwise kind build` and `shardwise kind up` make (the README's "On a real cluster" block):
a 1 + 4 node cluster from our node image, the chart installed with the operator image, and the
SmolLM2 demo ShardedModel run by the worker image:
- its tensor x pipeline ranks run in pods on different kind nodes (gloo over the pod network) and
  answer a completion through the Service;
- `docker stop` of the node holding a stage: the operator re-plans on the nodes left and the model
  answers again, with the same greedy text;
- `helm upgrade` of the chart keeps the ShardedModel and its pods.

Needs Docker (`shardwise kind docker`); without it the suite is skipped, unless SHARDWISE_REQUIRE_KIND
is set (CI), when it fails instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shardwise.e2e import build, images, nodeimage
from shardwise.e2e.docker import DockerError, check_daemon
from shardwise.e2e.kindcluster import KindCluster
from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.kind, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
DEMO = ROOT / "examples" / "smollm2-demo.yaml"
MODEL = "smollm2-demo"
OPERATOR_NS = "shardwise-system"
MODEL_NS = "models"
TAG = "e2e"


def say(line: str) -> None:
    print(line, flush=True)


@pytest.fixture(scope="module")
def kind_cluster():
    try:
        check_daemon()
    except DockerError as e:
        if os.environ.get("SHARDWISE_REQUIRE_KIND"):
            raise
        pytest.skip(str(e))
    build.build(say=say, wanted=(*build.ALL_BINARIES, *build.KIND_BINARIES))
    nodeimage.build_node_image(say=say)
    images.build_product(TAG, say=say)
    cluster = KindCluster("shardwise-e2e")
    if cluster.exists():
        cluster.delete()
    cluster.create(say=say)
    try:
        cluster.pushed = cluster.push_product(images.product_images(TAG), say=say)
        cluster.kubectl("create", "namespace", MODEL_NS)
        cluster.helm("install", "shardwise", str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
                     *_chart_values(cluster.pushed), "--wait", "--timeout", "300s")
        yield cluster
    finally:
        if not os.environ.get("SHARDWISE_KEEP_KIND"):
            cluster.delete()


def _chart_values(names: images.ProductImages) -> list[str]:
    repository, tag = names.operator.rsplit(":", 1)
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", f"operator.workerImage={names.worker}", "--set", "replicaCount=1"]


def model(cluster: KindCluster) -> dict:
    return json.loads(cluster.kubectl("get", "sm", MODEL, "-n", MODEL_NS, "-o", "json"))


def phase(cluster: KindCluster) -> str:
    return (model(cluster).get("status") or {}).get("phase", "")


def ready_pods(cluster: KindCluster) -> list[dict]:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", MODEL_NS, "-l", f"shardwise.dev/model={MODEL}",
                                      "-o", "json"))["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


@contextlib.contextmanager
def port_forward(cluster: KindCluster, target: str, remote: int):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}",
                             "-n", MODEL_NS, "port-forward", "--address", "127.0.0.1", target,
                             f"{port}:{remote}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def complete(cluster: KindCluster, prompt: str = "The capital of France is") -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()

    def ask() -> str:
        with port_forward(cluster, f"svc/{MODEL}", 8000) as url:
            def once():
                req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    return json.load(resp)["choices"][0]["text"]
            return wait_until(once, 60, "the port-forward to answer", interval=1, retry_on=(OSError,))

    return wait_until(ask, 300, "a completion through the Service", interval=5, retry_on=(OSError,))


def test_sharded_model_spans_nodes_answers_and_recovers_from_a_node_stop(kind_cluster):
    cluster = kind_cluster
    cluster.kubectl("apply", "-n", MODEL_NS, "-f", str(DEMO))
    start = time.monotonic()
    wait_until(lambda: phase(cluster) == "Ready", 1200, f"{MODEL} Ready", interval=5,
               retry_on=(DockerError,))
    say(f"{MODEL} Ready {time.monotonic() - start:.0f}s after kubectl apply")
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


def test_helm_upgrade_keeps_every_sharded_model(kind_cluster):
    cluster = kind_cluster
    if not cluster.kubectl("get", "sm", MODEL, "-n", MODEL_NS, "--ignore-not-found", "-o", "name").strip():
        cluster.kubectl("apply", "-n", MODEL_NS, "-f", str(DEMO))
    uid = model(cluster)["metadata"]["uid"]
    # A changed chart: another log level, rolled out by `helm upgrade`.
    cluster.helm("upgrade", "shardwise", str(CHART), "--namespace", OPERATOR_NS, *_chart_values(cluster.pushed),
                 "--set", "operator.logLevel=debug", "--wait", "--timeout", "300s")
    assert model(cluster)["metadata"]["uid"] == uid, "the upgrade replaced the ShardedModel"
    crd = json.loads(cluster.kubectl("get", "crd", "shardedmodels.shardwise.dev", "-o", "json"))
    assert not crd["metadata"].get("deletionTimestamp")
    wait_until(lambda: phase(cluster) == "Ready", 1200, f"{MODEL} Ready after the upgrade", interval=5,
               retry_on=(DockerError,))
