"""`shardwise worker` as the operator runs it: two pods (pipeline stages) of one replica, each
with two TP ranks, read their pod contract, rendezvous through MASTER_ADDR/MASTER_PORT and serve
the API from stage 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch

from shardwise.crds.contract import ModelContract, PodContract, ServingContract
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.e2e import processes
from shardwise.worker.serving.rank import free_port
from shardwise.worker.weights.tokenizer import from_hf_dir


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return None, b""


def test_two_stage_pods_serve_the_same_tokens_as_transformers(tmp_path, tiny_model):
    model = tiny_model(tmp_path / "model", layers=3, hidden=64, heads=4, kv_heads=2)
    plan = ShardPlan(tensor=2, pipeline=2, replicas=1, num_layers=3, placements=[
        StagePlacement(replica=0, stage=0, node="n0", gpus=2, layer_start=0, layer_end=2, embedding=True, head=False),
        StagePlacement(replica=0, stage=1, node="n1", gpus=2, layer_start=2, layer_end=3, embedding=False, head=True),
    ])
    master, api, health = free_port(), free_port(), free_port()
    pods = []
    for stage, port in ((0, api), (1, health)):
        # Each pod its own copy of the contract: on this one machine they cannot share a port.
        contract = tmp_path / f"contract-{stage}.json"
        contract.write_text(PodContract(
            plan=plan, model=ModelContract(path=str(model), format="auto", dtype="auto"), workload="inference",
            serving=ServingContract(port=port, model_name="tiny"), termination_log=str(tmp_path / "log")).to_json())
        env = {**os.environ, "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": str(stage), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master), "POD_IP": "127.0.0.1"}
        pods.append(subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", str(contract),
                                      "--device", "cpu"], env=env, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if _get(f"http://127.0.0.1:{api}/healthz")[0] == 200 and _get(f"http://127.0.0.1:{health}/healthz")[0] == 200:
                break
            assert all(p.poll() is None for p in pods), [p.stderr.read() for p in pods]
            time.sleep(0.5)
        else:
            raise AssertionError("pods did not become ready")
        assert json.loads(_get(f"http://127.0.0.1:{health}/healthz")[1])["ranks"] == [2, 3]
        metrics = _get(f"http://127.0.0.1:{health}/metrics")[1].decode()
        assert 'shardwise_weight_bytes{rank="3",stage="1",tp_rank="1"}' in metrics

        req = urllib.request.Request(f"http://127.0.0.1:{api}/v1/completions", data=json.dumps(
            {"prompt": "all that glitters", "max_tokens": 6, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        text = answer["choices"][0]["text"]
        assert answer["model"] == "tiny"    # the contract's serving.model_name

        from transformers import LlamaForCausalLM
        tok = from_hf_dir(str(model), [])
        ids = tok.encode("all that glitters")
        hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert text == tok.decode(ref[0, len(ids):].tolist())
    finally:
        for p in pods:      # all asked at once: a rank may wait on its peers as it stops
            p.terminate()
        for p in pods:
            processes.stop(p, 30)
