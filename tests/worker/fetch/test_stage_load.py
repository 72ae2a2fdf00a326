"""A sharded safetensors model split over pipeline stages: each stage's pod fetches only the files
holding its own tensors (select.py), and then loads its stage from that partial folder with the
worker's own loading (rank.validate, loader.load_stage), getting what the whole folder gives. A
folder lacking a file that a stage reads still fails that stage in one line naming the file,
before any rank starts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shardwise.e2e import processes
import torch

from shardwise.crds.contract import ModelContract, PodContract, ServingContract, SourceContract
from shardwise.crds.layout import split_layers
from shardwise.crds.modelsource import parse_model_uri
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Store
from shardwise.worker.serving.rank import RankSpec, free_port, validate
from shardwise.worker.weights.loader import load_stage, open_model

PIPELINE = 2


def _load(folder, stage: int, ranges) -> dict[str, torch.Tensor]:
    """Stage `stage` as its rank loads it from `folder` (serving/rank.py setup_rank)."""
    source = open_model(str(folder))
    start, end = ranges[stage]
    model = load_stage(source, start, end, embedding=stage == 0, head=stage == PIPELINE - 1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _ranges(folder):
    return split_layers(open_model(str(folder)).config.facts(), PIPELINE).ranges


def test_each_stage_loads_from_its_own_fetch_what_the_whole_folder_gives(s3_server, s3_config, s3_model,
                                                                         sharded_model, tmp_path):
    ranges = _ranges(sharded_model)
    weights = {p.name for p in sharded_model.glob("*.safetensors")}
    for stage in range(PIPELINE):
        node = tmp_path / f"node-{stage}"          # one pod per stage, each on its own node
        report = fetch_stage(ModelCache(CacheConfig(node, 1 << 30, disk_reserve_bytes=0)),
                             S3Store(parse_model_uri("s3://models/tiny"), s3_config, s3_server.env()),
                             "s3", "models/tiny", stage=stage, pipeline=PIPELINE)
        fetched = {p.name for p in report.files_dir.glob("*.safetensors")}
        assert fetched and fetched < weights, fetched      # only the stage's share is on its node
        got, want = _load(report.files_dir, stage, ranges), _load(sharded_model, stage, ranges)
        assert got.keys() == want.keys() and got
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        # what the pod checks before starting the stage's ranks passes too
        validate(RankSpec(model=str(report.files_dir), pipeline=PIPELINE), stages=[stage])


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, OSError):
        return None


def test_two_stage_pods_each_with_only_its_files_answer_the_whole_models_tokens(s3_server, s3_model,
                                                                               sharded_model, tmp_path):
    """Two `shardwise worker` pods (the stages of one replica), each fetching its share from the
    store into its own node's cache, serve the tokens transformers gives from the whole folder."""
    ranges = _ranges(sharded_model)
    plan = ShardPlan(tensor=1, pipeline=PIPELINE, replicas=1, num_layers=4, placements=[
        StagePlacement(replica=0, stage=s, node=f"n{s}", gpus=1, layer_start=ranges[s][0], layer_end=ranges[s][1],
                       embedding=s == 0, head=s == PIPELINE - 1) for s in range(PIPELINE)])
    master, ports = free_port(), [free_port() for _ in range(PIPELINE)]
    pods, logs = [], []
    for stage in range(PIPELINE):
        contract = tmp_path / f"contract-{stage}.json"
        contract.write_text(PodContract(
            plan=plan, model=ModelContract(path="s3://models/tiny", format="auto", dtype="auto"),
            workload="inference", serving=ServingContract(port=ports[stage], model_name="tiny"),
            termination_log=str(tmp_path / "log"),
            source=SourceContract(uri="s3://models/tiny", scheme="s3", endpoint=s3_server.endpoint,
                                  path_style=True, cache="node", cache_dir=str(tmp_path / f"node-{stage}"),
                                  cache_budget=1 << 30)).to_json())
        logs.append(tmp_path / f"stage-{stage}.log")
        env = {**os.environ, **s3_server.env(), "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": str(stage),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "POD_IP": "127.0.0.1"}
        with open(logs[-1], "w") as log:
            pods.append(subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", str(contract),
                                          "--device", "cpu"], env=env, stdout=log, stderr=log))
    try:
        deadline = time.time() + 120
        while not all(_get(f"http://127.0.0.1:{p}/healthz") == 200 for p in ports):
            assert time.time() < deadline and all(p.poll() is None for p in pods), [x.read_text() for x in logs]
            time.sleep(0.3)
        weights = {p.name for p in sharded_model.glob("*.safetensors")}
        for stage in range(PIPELINE):
            fetched = {p.name for p in (tmp_path / f"node-{stage}").glob("entries/*/files/*.safetensors")}
            assert fetched and fetched < weights, (stage, fetched)
        req = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v1/completions", data=json.dumps(
            {"prompt": "all that glitters", "max_tokens": 6, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
    finally:
        for p in pods:      # all asked at once: a rank may wait on its peers as it stops
            p.terminate()
        for p in pods:
            processes.stop(p, 30)
    # the reference: the whole folder's model in one piece, greedy, no cache
    from shardwise.worker.weights.tokenizer import from_hf_dir
    tok = from_hf_dir(str(sharded_model), [])
    ids = tok.encode("all that glitters")
    whole = load_stage(open_model(str(sharded_model)), 0, 4, embedding=True, head=True)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(whole(torch.tensor([ids]))[0, -1].argmax()))
    assert text == tok.decode(ids[-6:])


def _file_of(folder: Path, tensor: str) -> str:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def test_a_stage_whose_weight_file_is_absent_fails_in_one_line_naming_it(sharded_model, tmp_path):
    folder = Path(shutil.copytree(sharded_model, tmp_path / "m"))
    ranges = _ranges(folder)
    last = ranges[-1][1] - 1                          # a layer only the last stage loads
    victim = _file_of(folder, f"model.layers.{last}.mlp.down_proj.weight")
    (folder / victim).unlink()
    # The first stage never reads that file: it loads as from the whole folder.
    got, want = _load(folder, 0, ranges), _load(sharded_model, 0, ranges)
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    # The last stage is refused before any rank starts (a pod validates its own stage), in one line.
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(model=str(folder), pipeline=PIPELINE), stages=[PIPELINE - 1])
    message = str(e.value)
    assert victim in message and "missing" in message and "\n" not in message
    # A local run loads every stage: refused as well. And a read that gets past the checks
    # (load_stage alone) fails in the same line.
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(model=str(folder), pipeline=PIPELINE))
    assert str(e.value) == message
    start, end = ranges[-1]
    with pytest.raises(WorkerError) as e:
        load_stage(open_model(str(folder)), start, end, embedding=False, head=True)
    assert victim in str(e.value) and "missing" in str(e.value) and "\n" not in str(e.value)


def test_a_folder_without_any_of_its_weight_files_is_refused_at_open(sharded_model, tmp_path):
    folder = Path(shutil.copytree(sharded_model, tmp_path / "m"))
    for p in folder.glob("*.safetensors"):
        p.unlink()
    with pytest.raises(WorkerError) as e:
        open_model(str(folder))
    assert "model-00001-of-00006.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_file_present_is_still_refused_at_open(sharded_model, tmp_path):
    """The files that are there are checked whole at open, absent ones or not."""
    folder = Path(shutil.copytree(sharded_model, tmp_path / "m"))
    files = sorted(folder.glob("*.safetensors"))
    files[0].unlink()
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[:-100])
    with pytest.raises(WorkerError) as e:
        open_model(str(folder))
    assert "truncated" in str(e.value) and files[-1].name in str(e.value)
