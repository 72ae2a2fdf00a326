"""`shardwise worker` with a remote model: a pod whose contract names `s3://models/tiny` fetches its
stage's files from a real S3 server into its cache folder, answers GET /download with its progress
while it does, with the stream count its contract gives (spec.model.fetchStreams), then serves the
API from the fetched folder and, on the same port, the fetch's final report; a second pod on the same
cache fetches nothing, and says so in its final report (what the operator's Downloaded Event
carries). The store is reached
through a slow link (a TCP relay that paces the server's bytes), so the fetch lasts long enough to
be watched."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import torch

from shardwise.crds import names
from shardwise.crds.contract import ModelContract, PodContract, ServingContract, SourceContract
from shardwise.crds.download import DownloadReport
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.e2e.slowlink import SlowLink
from shardwise.worker.serving.rank import free_port
from shardwise.worker.weights.tokenizer import from_hf_dir

LINK_BYTES_PER_S = 256 << 10


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None, b""


def _start_pod(tmp_path, name, endpoint, cache, port, master, env, streams=None):
    plan = ShardPlan(tensor=1, pipeline=1, replicas=1, num_layers=4, placements=[
        StagePlacement(replica=0, stage=0, node="n0", gpus=1, layer_start=0, layer_end=4, embedding=True, head=True)])
    contract = tmp_path / f"contract-{name}.json"
    contract.write_text(PodContract(
        plan=plan, model=ModelContract(path="s3://models/tiny", format="auto", dtype="auto"),
        workload="inference", serving=ServingContract(port=port, model_name="tiny"),
        termination_log=str(tmp_path / "log"),
        source=SourceContract(uri="s3://models/tiny", scheme="s3", endpoint=endpoint, path_style=True,
                              cache="node", cache_dir=str(cache), cache_budget=1 << 30,
                              streams=streams)).to_json())
    log = open(tmp_path / f"{name}.log", "w+")
    env = {**os.environ, **env, "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master), "POD_IP": "127.0.0.1"}
    pod = subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", str(contract),
                            "--device", "cpu"], env=env, stderr=log, stdout=log, text=True)
    return pod, tmp_path / f"{name}.log"


def _final(port: int) -> tuple[bool, int, int, int]:
    """(done, bytes fetched, of, bytes the cache held) of the pod's GET /download."""
    status, body = _get(f"http://127.0.0.1:{port}{names.DOWNLOAD_PROGRESS_PATH}")
    assert status == 200, (status, body)
    r = DownloadReport.model_validate_json(body)
    return r.done, r.bytes_fetched, r.bytes_total, r.bytes_cached


def _stop(pod) -> None:
    pod.send_signal(signal.SIGTERM)
    try:
        pod.wait(30)
    except subprocess.TimeoutExpired:
        pod.kill()


def test_a_pod_fetches_its_files_shows_progress_then_serves(s3_server, s3_model, sharded_model, tmp_path):
    up = urlparse(s3_server.endpoint)
    link = SlowLink((up.hostname, up.port), LINK_BYTES_PER_S)
    cache, port = tmp_path / "node-cache", free_port()
    pod, log = _start_pod(tmp_path, "first", f"http://127.0.0.1:{link.port}", cache, port, free_port(),
                          s3_server.env(), streams=3)      # spec.model.fetchStreams
    reports = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if _get(f"http://127.0.0.1:{port}/healthz")[0] == 200:
                break
            status, body = _get(f"http://127.0.0.1:{port}/download")
            if status == 200:
                reports.append(DownloadReport.model_validate_json(body))
            assert pod.poll() is None, log.read_text()
            time.sleep(0.1)
        else:
            raise AssertionError(f"the pod did not become ready: {log.read_text()}")
        files = [p for p in cache.glob("entries/*/files/**/*") if p.is_file()]
        whole = sum(p.stat().st_size for p in files)
        assert {p.name for p in files} >= {p.name for p in sharded_model.glob("*.safetensors")}
        moving = [r for r in reports if not r.done and 0 < r.bytes_fetched < r.bytes_total]
        assert moving, reports               # progress seen mid-download
        assert all(r.bytes_cached == 0 and r.bytes_total <= whole and r.error is None for r in reports)
        assert [r.bytes_total for r in reports] == sorted(r.bytes_total for r in reports)
        assert any(r.rate > 0 for r in moving)
        # Ready and serving, the pod answers how its fetch ended on the same port, for its life
        assert _final(port) == (True, whole, whole, 0)
        fetched = [line for line in log.read_text().splitlines() if "fetched" in line]
        assert len(fetched) == 1 and "reused 0.0 MiB from the node's cache" in fetched[0], fetched
        assert fetched[0].endswith("over 3 streams"), fetched

        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(
            {"prompt": "all that glitters", "max_tokens": 6, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        from transformers import LlamaForCausalLM
        tok = from_hf_dir(str(sharded_model), [])
        ids = tok.encode("all that glitters")
        hf = LlamaForCausalLM.from_pretrained(sharded_model, dtype=torch.float32).eval()
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert text == tok.decode(ref[0, len(ids):].tolist())
    finally:
        _stop(pod)
    # the same node's cache: a second pod (a restarted or re-planned group) fetches nothing
    port2 = free_port()
    again, log2 = _start_pod(tmp_path, "second", f"http://127.0.0.1:{link.port}", cache, port2,
                             free_port(), s3_server.env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and _get(f"http://127.0.0.1:{port2}/healthz")[0] != 200:
            assert again.poll() is None, log2.read_text()
            time.sleep(0.2)
        line = next(x for x in log2.read_text().splitlines() if "fetched" in x)
        assert "fetched 0.0 MiB" in line and "reused 0.0 MiB" not in line, line
        assert line.endswith(f"over {names.FETCH_STREAMS} streams"), line     # unset: the default
        # a start from a warm cache, over before anyone could read it, still says what it reused
        assert _final(port2) == (True, 0, 0, whole)
    finally:
        _stop(again)
        link.close()
