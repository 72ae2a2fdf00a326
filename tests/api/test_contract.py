"""The pod contract: what the planner decides reaches the worker unchanged, through the renderer's
ConfigMap and the worker's own reading function (no torch needed)."""
from __future__ import annotations

import base64
import gzip
import json
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from shardwise.crds import compressed, names
from shardwise.crds.contract import CONTRACT_MAX_BYTES, ContractError, PodContract, load_contract
from shardwise.crds.models import ShardedModel, ShardedModelSpec, Workload
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.render import renderer
from shardwise.operator.planning.inventory import NodeInfo
from shardwise.operator.planning.planner import GiB, plan
from shardwise.worker.cli.pod import read_contract
from shardwise.worker.errors import WorkerError

ZONE, RACK = "topology.kubernetes.io/zone", "topology.shardwise.dev/rack"
SMOL = from_hf_config(dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           hidden_size=576, intermediate_size=1536, vocab_size=49152,
                           tie_word_embeddings=True), "bfloat16")


def _model(**spec) -> ShardedModel:
    base = {"model": {"uri": "pvc://weights/smollm2"}, "parallelism": {"tensor": 3, "pipeline": 2, "replicas": 2},
            "dtype": "bfloat16"}
    return ShardedModel(metadata={"name": "smol", "namespace": "prod", "uid": "u-1"},
                        spec=ShardedModelSpec.model_validate({**base, **spec}))


def _mounted(configmap: dict, folder) -> Path:
    """The ConfigMap's contract file as a kubelet writes it into the pod: binaryData, decoded."""
    path = folder / names.CONTRACT_FILE
    path.write_bytes(base64.b64decode(configmap["binaryData"][names.CONTRACT_FILE]))
    return path


def _nodes() -> list[NodeInfo]:
    # One node without a memory label: the plan carries a note about it.
    return [NodeInfo(f"n{i}", {ZONE: f"z{i % 2}", RACK: f"r{i}"}, gpus=4, used=1,
                     gpu_memory=0 if i == 3 else 24 * GiB) for i in range(4)]


def test_the_pod_reads_exactly_the_plan_the_planner_made(tmp_path):
    model = _model()
    planned = plan(model.spec, SMOL, _nodes())
    assert planned.notes and planned.memory_per_gpu and planned.topology_keys
    assert all(p.params and p.domains for p in planned.placements) and len(planned.placements) == 4

    configmap = renderer.render_configmap(model, planned)
    path = _mounted(configmap, tmp_path)
    contract = read_contract(str(path))     # what `shardwise worker --contract` does

    assert contract.plan == planned
    assert contract.plan.model_dump() == planned.model_dump()
    assert contract.model.path == "/models/weights/smollm2" and contract.model.dtype == "bfloat16"
    assert renderer.plan_from_configmap(configmap) == planned


def test_a_training_contract_carries_the_specs_options_with_pod_paths(tmp_path):
    model = _model(workload="training", parallelism={"tensor": 1, "pipeline": 2, "replicas": 2},
                   training={"data": "pvc://corpora/wiki.txt", "steps": 50, "microBatches": 4},
                   checkpoint={"claim": "ckpt", "intervalSteps": 10})
    planned = plan(model.spec, SMOL, _nodes())
    contract = PodContract.from_json(renderer.configmap_contract(renderer.render_configmap(model, planned)))
    assert contract.workload == "training" and contract.plan == planned
    assert contract.training == model.spec.training.model_copy(update={"data": "/data/corpora/wiki.txt"})
    assert contract.checkpoint == model.spec.checkpoint and contract.checkpoint.path == "/checkpoints"


def test_the_local_checkpoint_tier_and_min_replicas_reach_the_pods_contract_json():
    model = _model(workload="training", parallelism={"tensor": 1, "pipeline": 2, "replicas": 2},
                   training={"data": "/data/wiki.txt", "steps": 50, "minReplicas": 1},
                   checkpoint={"claim": "ckpt", "local": {"intervalSteps": 5, "keep": 3}})
    configmap = renderer.render_configmap(model, plan(model.spec, SMOL, _nodes()))
    contract = PodContract.from_json(renderer.configmap_contract(configmap))
    local = contract.checkpoint.local
    assert (local.path, local.interval_steps, local.keep) == ("/local-checkpoints", 5, 3)
    assert contract.training.min_replicas == 1


def test_zero3_schedule_and_compression_reach_the_pods_contract_json(tmp_path):
    """spec.training's layout fields and the plan's ZeRO-3 shard degree, through the ConfigMap and
    back: what the worker builds its device mesh and schedule from."""
    model = _model(workload="training", parallelism={"tensor": 1, "pipeline": 2, "replicas": 4},
                   training={"data": "/data/wiki.txt", "steps": 50, "microBatches": 4,
                             "dataParallel": {"shard": 2}, "schedule": "Interleaved1F1B",
                             "activationCheckpointing": True,
                             "gradientCompression": {"method": "topk", "density": 0.05}},
                   checkpoint={"claim": "ckpt"})
    planned = plan(model.spec, SMOL, [NodeInfo(f"n{i}", {ZONE: "z", RACK: "r"}, gpus=4, used=0,
                                               gpu_memory=24 * GiB) for i in range(2)])
    assert (planned.data_shard, planned.data_replicate) == (2, 2)
    configmap = renderer.render_configmap(model, planned)
    raw = json.loads(renderer.configmap_contract(configmap))
    assert raw["plan"]["data_shard"] == 2
    assert raw["training"]["data_parallel"] == {"shard": 2, "replicate": None}
    assert (raw["training"]["schedule"], raw["training"]["activation_checkpointing"]) == ("Interleaved1F1B", True)
    assert raw["training"]["gradient_compression"] == {"method": "topk", "density": 0.05, "warmup_steps": 0, "rank": 8}

    contract = read_contract(str(_mounted(configmap, tmp_path)))
    assert contract.plan == planned and contract.plan.data_shard == 2 and contract.plan.data_replicate == 2
    assert contract.training == model.spec.training
    t = contract.training
    assert (t.data_parallel.shard, t.schedule, t.activation_checkpointing) == (2, "Interleaved1F1B", True)
    assert (t.gradient_compression.method, t.gradient_compression.density) == ("topk", 0.05)
    assert renderer.plan_from_configmap(configmap).data_shard == 2


def test_a_plan_written_before_data_shard_reads_as_unsharded():
    """A contract whose plan has no data_shard (as written before the field existed)."""
    model = _model()
    planned = plan(model.spec, SMOL, _nodes())
    old = json.loads(renderer.configmap_contract(renderer.render_configmap(model, planned)))
    del old["plan"]["data_shard"]
    stored = base64.b64encode(compressed.compress(json.dumps(old).encode())).decode()
    read = renderer.plan_from_configmap({"binaryData": {names.CONTRACT_FILE: stored}})
    assert read is not None and (read.data_shard, read.data_replicate) == (1, read.replicas)


@pytest.mark.parametrize("text, words", [
    (None, "not found"),
    ("{not json", "is not a valid pod contract: Invalid JSON"),
    ('{"tensor": 1, "pipeline": 1, "replicas": 1, "num_layers": 2}', "is not a valid pod contract: plan: Field required"),
])
def test_a_missing_or_invalid_contract_is_one_line(tmp_path, text, words):
    path = tmp_path / "contract.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ContractError, match=words) as raised:
        load_contract(path)
    assert "\n" not in str(raised.value) and str(path) in str(raised.value)
    with pytest.raises(WorkerError, match=words):
        read_contract(str(path))


def test_a_training_contract_without_its_options_is_refused():
    contract = PodContract.from_json(renderer.configmap_contract(
        renderer.render_configmap(_model(), plan(_model().spec, SMOL, _nodes()))))
    with pytest.raises(ContractError, match="a training contract needs training and checkpoint"):
        PodContract.from_json(contract.model_copy(update={"workload": Workload.TRAINING}).to_json())


def test_the_worker_exits_2_in_one_line_without_a_traceback(tmp_path, bomb):
    (tmp_path / "contract.json").write_text("{}")
    (tmp_path / "contract.json.gz").write_bytes(bomb)
    for path in (tmp_path / "missing.json", tmp_path / "contract.json", tmp_path / "contract.json.gz"):
        p = subprocess.run([sys.executable, "-m", "shardwise", "worker", "--contract", str(path)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().startswith("shardwise worker: error: ") and len(p.stderr.strip().splitlines()) == 1
        assert "Traceback" not in p.stderr


def _gzip_bomb(size: int = 1 << 30) -> bytes:
    """`size` bytes of zeros as one valid gzip stream of about 1 MB, built without compressing them
    all: after a full flush the compressor starts afresh, so every further MiB compresses alike."""
    mib = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    first = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    again = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(size >> 20):
        crc = zlib.crc32(mib, crc)
    end = deflate.flush()[:-8] + struct.pack("<II", crc, size & 0xFFFFFFFF)   # the whole stream's trailer
    return first + again * ((size >> 20) - 1) + end


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = _gzip_bomb()
    assert len(data) < 2 << 20
    return data


def test_the_configmaps_contract_is_gzip_and_a_plain_contract_written_by_hand_still_loads(tmp_path):
    configmap = renderer.render_configmap(_model(), plan(_model().spec, SMOL, _nodes()))
    mounted = _mounted(configmap, tmp_path)
    assert mounted.name == "contract.json.gz" and mounted.read_bytes()[:2] == b"\x1f\x8b"
    contract = read_contract(str(mounted))
    indented, compact = tmp_path / "contract.json", tmp_path / "compact.json"
    indented.write_text(contract.to_json())                      # as `docs/worker.md` shows one
    compact.write_bytes(renderer.configmap_contract(configmap))  # the ConfigMap's, gunzipped
    assert read_contract(str(indented)) == contract == load_contract(compact)


def test_a_gzip_bomb_is_refused_quickly_in_one_line_by_the_worker_and_the_operator(tmp_path, bomb):
    path = tmp_path / "contract.json.gz"
    path.write_bytes(bomb)
    configmap = {"binaryData": {names.CONTRACT_FILE: base64.b64encode(bomb).decode()}}
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ContractError) as raised:
            load_contract(path)
        with pytest.raises(WorkerError, match="inflates to more than 64 MiB$"):
            read_contract(str(path))
        assert renderer.plan_from_configmap(configmap) is None
        with pytest.raises(ContractError) as from_configmap:
            renderer.configmap_contract(configmap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(raised.value) == f"pod contract {path} inflates to more than 64 MiB"
    assert str(from_configmap.value) == "the ConfigMap's contract.json.gz inflates to more than 64 MiB"
    assert time.monotonic() - started < 10 and peak < 256 << 20     # not 1 GiB inflated, nor held


def test_a_contract_file_over_the_bound_is_refused_unread(tmp_path):
    path = tmp_path / "contract.json"
    with open(path, "wb") as f:
        f.truncate(CONTRACT_MAX_BYTES + 1)
    with pytest.raises(ContractError, match=f"^pod contract {path} is larger than 64 MiB$"):
        load_contract(path)


@pytest.mark.parametrize("data, words", [
    (b"\x1f\x8bnot gzip", "is not valid gzip"),
    (gzip.compress(b'{"plan": {}}')[:-12], "is truncated gzip"),
    (gzip.compress(b"{}") + gzip.compress(b"{}"), "has data after its gzip stream"),
], ids=["not-gzip", "truncated", "trailing-data"])
def test_broken_gzip_is_one_line_naming_the_file(tmp_path, data, words):
    path = tmp_path / "contract.json.gz"
    path.write_bytes(data)
    with pytest.raises(ContractError, match=words) as raised:
        load_contract(path)
    assert str(raised.value).startswith(f"pod contract {path} ") and "\n" not in str(raised.value)
