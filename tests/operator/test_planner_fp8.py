"""Training memory with training.precision fp8 (torchao's tensorwise recipe): the sharded ZeRO-3
state is unchanged, a decoder layer gathered by FSDP is 1 byte a parameter (float8 all-gather)."""
from __future__ import annotations

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.planning.layouts import largest_unit, stage_memory, training_state_bytes

LLAMA_8B = from_hf_config(dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               hidden_size=4096, intermediate_size=14336, vocab_size=128256), "bfloat16")
LAYER = LLAMA_8B.layer_params


def spec(precision: str) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({
        "model": {"uri": "/models/m"}, "workload": "training", "dtype": "bfloat16",
        "parallelism": {"replicas": 8, "tensor": 2, "pipeline": 4},
        "training": {"data": "/d.txt", "steps": 1, "precision": precision}, "checkpoint": {"claim": "c"}})


def test_fp8_gathers_a_decoder_layer_in_one_byte_a_parameter_and_keeps_the_sharded_state():
    params = 8 * LAYER
    bf16 = training_state_bytes(LLAMA_8B, params, tensor=2, shard=4, block=LAYER)
    fp8 = training_state_bytes(LLAMA_8B, params, tensor=2, shard=4, block=LAYER, fp8=True)
    assert bf16 - fp8 == 2 * LAYER * (2 - 1) / 2          # two layers in flight, 1 byte saved each
    assert fp8 - 2 * LAYER * 1 / 2 == 16 * params / 8      # master weights, gradients, moments: as before


def test_fp8_changes_nothing_without_fsdp_sharding_or_when_the_embedding_is_the_largest_unit():
    params = 8 * LAYER
    assert training_state_bytes(LLAMA_8B, params, 2, 1, LAYER, fp8=True) == \
        training_state_bytes(LLAMA_8B, params, 2, 1, LAYER)     # no float8 all-gather with one shard
    embedding = largest_unit(LLAMA_8B, True, False)
    assert embedding > LAYER
    assert training_state_bytes(LLAMA_8B, params, 2, 4, embedding, fp8=True) == \
        training_state_bytes(LLAMA_8B, params, 2, 4, embedding)   # never converted: compute dtype


def test_a_stage_plans_less_memory_in_fp8_by_exactly_the_gathered_layers():
    layers = 8
    default, fp8 = (stage_memory(LLAMA_8B, spec(p), 2, layers * LAYER, layers, shard=4, block=LAYER, stage=1,
                                 pipeline=4) for p in ("default", "fp8"))
    assert default - fp8 == LAYER      # 2 layers in flight x 1 byte saved / tensor 2
    assert "precision" not in spec("default").model_dump(by_alias=True)["training"]   # pods do not roll
