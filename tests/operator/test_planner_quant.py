"""Fitting a model onto fewer or smaller GPUs: spec.serving.quantization (the planner sizes INT8
weights and a GGUF's kept Q8_0/Q4_0/Q4_1 blocks by the worker's rule, and with `auto` quantizes only
when the GPUs cannot hold the model in spec.dtype, a GGUF's own blocks before INT8) and
spec.serving.offload (layers streamed from host memory, only when nothing else places every
replica); a plan that uses either says so in its first note."""
from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.planning.layouts import ACTIVATION_FRACTION, CUDA_OVERHEAD, USABLE_FRACTION
from shardwise.operator.planning.planner import GiB, LayoutError, PlanError, plan
from tests.operator.builders import gpu_node as node
from tests.operator.test_planner import LLAMA_70B, SMOL

LLAMA_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                intermediate_size=14336, vocab_size=128256)


def serving(quantization: str, offload: bool = False, **parallelism) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({"model": {"uri": "/models/m"}, "parallelism": parallelism,
                                            "serving": {"quantization": quantization, "offload": offload}})


def brute_force_int8_bytes(cfg: dict, tied: bool) -> int:
    """Every tensor of a Llama with these shapes, one by one: the layers' matrices at one byte an
    element and a bfloat16 scale per 32 inputs of each row, everything else in bf16."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    matrices = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]          # [out, in]
    per_layer = sum(o * n + 2 * o * (n // 32) for o, n in matrices) + 2 * h * 2                  # + two norms
    outside = cfg["vocab_size"] * h * (1 if tied else 2) + h                        # embedding(s), final norm
    return layers * per_layer + outside * 2


@pytest.mark.parametrize("cfg,tied", [(LLAMA_8B, False), (dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192,
                                                                 num_hidden_layers=16), True)])
def test_int8_sizing_matches_every_tensor_counted(cfg, tied):
    facts = from_hf_config(dict(cfg, tie_word_embeddings=tied), "bfloat16")
    int8 = facts.quantized("int8")
    assert int8.weight_bytes == pytest.approx(brute_force_int8_bytes(cfg, tied), rel=1e-6)
    assert 0.5 < int8.weight_bytes / facts.weight_bytes < 0.7     # the embeddings stay in bf16
    assert facts.quantized("none") is facts


def test_int8_always_and_none_never():
    nodes = [node("n1", 8)]
    assert plan(serving("int8"), SMOL, nodes).quantization == "int8"
    assert plan(serving("none"), SMOL, nodes).quantization == "none"
    assert plan(serving("int8"), SMOL, nodes).memory_per_gpu < plan(serving("none"), SMOL, nodes).memory_per_gpu


def test_auto_keeps_the_dtype_when_it_fits():
    result = plan(serving("auto"), SMOL, [node("n1", 8)])
    assert result.quantization == "none" and not any("int8" in n for n in result.notes)


def test_auto_quantizes_when_the_gpus_cannot_hold_the_model_and_says_why():
    # 70B in bf16 needs ~140 GiB of weights: two free 48 GiB GPUs hold it only in int8
    nodes = [node("n1", 2, memory_gib=48)]
    with pytest.raises(PlanError, match="needs"):
        plan(serving("none"), LLAMA_70B, nodes)
    result = plan(serving("auto"), LLAMA_70B, nodes)
    assert result.quantization == "int8" and result.tensor * result.pipeline <= 2
    assert result.notes[0].startswith("int8 weights (serving.quantization auto; 2 -> 1.")
    assert "since at dtype auto: needs" in result.notes[0]


def test_auto_prefers_int8_to_fewer_replicas():
    nodes = [node("n1", 2, memory_gib=48)]
    spec = ShardedModelSpec.model_validate({"model": {"uri": "/m"}, "parallelism": {"replicas": 2},
                                            "serving": {"quantization": "auto"},
                                            "recovery": {"allowShrink": True}})
    # 2 GPUs of 48 GiB: SMOL fits twice either way, so no quantization
    assert plan(spec, SMOL, nodes).quantization == "none"
    result = plan(spec, LLAMA_70B, [node("n1", 2, memory_gib=48), node("n2", 2, memory_gib=48)])
    assert result.quantization == "int8" and result.replicas == 2 and not result.shrunk


def test_unknown_quantization_is_refused():
    with pytest.raises(ValidationError, match="quantization"):
        serving("int4")


def test_offload_streams_layers_only_when_nothing_else_fits():
    # 70B in bf16 (~131 GiB of weights) on one free 48 GiB GPU: only streaming runs it
    nodes = [node("n1", 1, memory_gib=48)]
    with pytest.raises(PlanError):
        plan(serving("none"), LLAMA_70B, nodes)
    result = plan(serving("none", offload=True), LLAMA_70B, nodes)
    assert (result.tensor, result.pipeline, result.quantization) == (1, 1, "none")
    weights = LLAMA_70B.weight_bytes
    assert 0 < result.offload_budget < weights
    assert result.memory_per_gpu <= 48 * GiB * USABLE_FRACTION
    # what stays resident, the KV cache and the overhead fill the GPU's usable memory, no more
    assert result.offload_budget + CUDA_OVERHEAD < 48 * GiB * USABLE_FRACTION
    assert result.notes[0].startswith(f"{result.offload_budget / GiB:.1f} GiB of weights resident per GPU")
    assert "since at dtype auto: needs" in result.notes[0]
    # where the model fits, offload changes nothing
    roomy = plan(serving("none", offload=True), SMOL, nodes)
    assert roomy.offload_budget == 0 and not any("streamed" in n for n in roomy.notes)


def test_int8_is_preferred_to_streaming():
    nodes = [node("n1", 2, memory_gib=48)]       # 70B fits two 48 GiB GPUs in int8, not in bf16
    result = plan(serving("auto", offload=True), LLAMA_70B, nodes)
    assert result.quantization == "int8" and result.offload_budget == 0
    small = [node("n1", 1, memory_gib=48)]        # one GPU: int8 and streaming both
    both = plan(serving("auto", offload=True), LLAMA_70B, small)
    assert both.quantization == "int8" and both.offload_budget > 0
    assert both.notes[0].startswith("int8 weights (serving.quantization auto; 2 -> 1.09 bytes a parameter) and ")


def test_training_never_streams():
    spec = ShardedModelSpec.model_validate({
        "model": {"uri": "/m"}, "workload": "training", "training": {"data": "/d.txt", "steps": 1},
        "checkpoint": {"claim": "c"}, "serving": {"offload": True, "quantization": "int8"}})
    with pytest.raises(PlanError):
        plan(spec, LLAMA_70B, [node("n1", 1, memory_gib=48)])


# ---------------------------------------------------------------- gguf: a GGUF file's own blocks

# 70B as a Q4_1 GGUF: the shape and the dtype from_gguf reports for such a file, held in bf16 otherwise
LLAMA_70B_Q4_1 = replace(LLAMA_70B, dtype="Q4_1")


def brute_force_gguf_bytes(cfg: dict, tied: bool, block_bytes: float, embedding_bytes: float = 2,
                           head_bytes: float = 2) -> float:
    """Every tensor of a transformers Llama with these shapes, built on the meta device and counted
    one by one: the decoder layers' 2-D weights at `block_bytes` an element, the embedding and the
    LM head at theirs, the norms in bf16; a tied head is the embedding, counted once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, tie_word_embeddings=tied))
    total = 0.0
    for name, tensor in model.named_parameters():
        in_layer_matrix = name.startswith("model.layers.") and tensor.dim() == 2
        vocab = {"model.embed_tokens.weight": embedding_bytes, "lm_head.weight": head_bytes}
        total += tensor.numel() * (block_bytes if in_layer_matrix else vocab.get(name, 2))
    return total


@pytest.mark.parametrize("qtype,block_bytes", [("Q4_1", 0.625), ("Q4_0", 0.625), ("Q8_0", 1.25)])
@pytest.mark.parametrize("cfg,tied", [(LLAMA_8B, False), (dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192,
                                                                 num_hidden_layers=16), True)])
def test_gguf_sizing_matches_every_tensor_counted(cfg, tied, qtype, block_bytes):
    facts = replace(from_hf_config(dict(cfg, tie_word_embeddings=tied), "auto"), dtype=qtype)
    assert facts.bytes_per_param == 2                      # dequantized, a GGUF would take bf16's room
    gguf = facts.quantized("gguf")
    assert gguf.weight_bytes == pytest.approx(brute_force_gguf_bytes(cfg, tied, block_bytes), rel=1e-6)
    # Q4 blocks take less than INT8; Q8_0, held as two 4-bit planes, a little more
    assert (gguf.weight_bytes < facts.quantized("int8").weight_bytes) == (qtype != "Q8_0")


@pytest.mark.parametrize("cfg,tied,types,table_bytes", [
    (LLAMA_8B, False, ("Q4_0", "Q6_K"), (0.625, 2)),     # llama.cpp's usual Q4_0: the head in Q6_K, dequantized
    (LLAMA_8B, False, ("Q8_0", "Q4_1"), (1.25, 0.625)),
    (dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16), True, ("Q8_0", "Q8_0"), (1.25, 1.25)),
])
def test_gguf_sizing_counts_the_embedding_and_head_in_their_blocks(cfg, tied, types, table_bytes):
    """The worker keeps a GGUF file's embedding and LM head in their own types' blocks where those
    are Q8_0, Q4_0 or Q4_1 (at any tensor degree): the rule counts them so, others in the dtype."""
    facts = replace(from_hf_config(dict(cfg, tie_word_embeddings=tied), "auto"), dtype="Q4_1",
                    embedding_dtype=types[0], head_dtype=types[1])
    want = brute_force_gguf_bytes(cfg, tied, 0.625, *table_bytes)
    assert facts.quantized("gguf").weight_bytes == pytest.approx(want, rel=1e-6)
    unknown = replace(facts, embedding_dtype="", head_dtype="")     # int8 keeps them in the dtype
    assert facts.quantized("int8").bytes_per_param == unknown.quantized("int8").bytes_per_param


def test_a_ggufs_head_is_planned_in_its_blocks_at_tp_2():
    """SmolLM2's Q4_1 file stores its tied embedding/head as Q8_0 (from_gguf reads the type): at
    TP 2 each GPU is planned with its half of that table in blocks, 1.25 bytes an element, not bf16's
    2. (SmolLM2 with 12 heads and 4 KV heads, which TP 2 divides: the widened file the worker's
    tests run TP 2 on, gguf_index.write_widened.)"""
    facts = replace(SMOL, heads=12, kv_heads=4, dtype="Q4_1", embedding_dtype="Q8_0", head_dtype="Q8_0")
    spec, nodes = serving("gguf", tensor=2, pipeline=1), [node("n1", 2)]
    result = plan(spec, facts, nodes)
    in_bf16 = plan(spec, replace(facts, embedding_dtype="", head_dtype=""), nodes)   # a type it does not know
    assert (result.tensor, result.pipeline, result.quantization) == (2, 1, "gguf")
    saved = (1 + ACTIVATION_FRACTION) * SMOL.vocab * SMOL.hidden * (2 - 1.25) / 2
    assert in_bf16.memory_per_gpu - result.memory_per_gpu == pytest.approx(saved, abs=2)


def test_auto_keeps_a_ggufs_blocks_before_int8_and_says_why():
    nodes = [node("n1", 2, memory_gib=48)]       # 70B fits two 48 GiB GPUs in its Q4_1 blocks or int8, not bf16
    with pytest.raises(PlanError, match="needs"):
        plan(serving("none"), LLAMA_70B_Q4_1, nodes)
    assert plan(serving("int8"), LLAMA_70B_Q4_1, nodes).quantization == "int8"
    result = plan(serving("auto"), LLAMA_70B_Q4_1, nodes)
    assert result.quantization == "gguf" and result.tensor * result.pipeline <= 2
    assert result.memory_per_gpu < plan(serving("int8"), LLAMA_70B_Q4_1, nodes).memory_per_gpu
    assert result.notes[0].startswith("gguf weights (serving.quantization auto; 2 -> 0.6")
    assert "since at dtype auto: needs" in result.notes[0]


def test_auto_on_a_bf16_model_never_keeps_gguf_blocks():
    bf16 = replace(LLAMA_70B, dtype="bfloat16")
    result = plan(serving("auto"), bf16, [node("n1", 2, memory_gib=48)])
    assert result.quantization == "int8" and not any("gguf" in n for n in result.notes)
    streamed = plan(serving("auto", offload=True), bf16, [node("n1", 1, memory_gib=48)])
    assert streamed.quantization == "int8" and streamed.offload_budget > 0


def test_streaming_a_q4_gguf_streams_its_blocks():
    # one 48 GiB GPU holds 70B neither in Q4_1 blocks nor in int8: stream the fewer bytes, the blocks
    result = plan(serving("auto", offload=True), LLAMA_70B_Q4_1, [node("n1", 1, memory_gib=48)])
    assert result.quantization == "gguf" and result.offload_budget > 0
    assert result.notes[0].startswith("gguf weights (serving.quantization auto; 2 -> 0.6")


def test_gguf_for_a_model_not_stored_in_such_blocks_is_one_line():
    bf16 = replace(SMOL, dtype="bfloat16")
    with pytest.raises(LayoutError) as e:        # the operator reports it as an invalid spec, not short capacity
        plan(serving("gguf"), bf16, [node("n1", 8)])
    assert str(e.value) == ("serving.quantization gguf keeps a GGUF file's Q8_0, Q4_0 or Q4_1 blocks; "
                            "this model is stored as bfloat16")
    with pytest.raises(LayoutError, match="this model is stored as Q6_K$"):
        plan(serving("gguf"), replace(SMOL, dtype="Q6_K"), [node("n1", 8)])
    assert plan(serving("gguf"), replace(SMOL, dtype="Q8_0"), [node("n1", 8)]).quantization == "gguf"
