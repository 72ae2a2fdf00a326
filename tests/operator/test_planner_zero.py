"""Training memory under ZeRO-3 (FSDP2) with mixed precision, and the shard degree the planner picks."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.crds.layout import split_layers
from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.planning import groups as planning
from shardwise.operator.planning.inventory import NodeInfo
from shardwise.operator.planning.activations import stage_activation_bytes
from shardwise.operator.planning.layouts import (CUDA_OVERHEAD, GiB, LayoutError, PlanError, largest_unit,
                                                training_state_bytes)
from shardwise.operator.planning.planner import plan
from tests.operator.builders import gpu_node

LLAMA_8B = from_hf_config(dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               hidden_size=4096, intermediate_size=14336, vocab_size=128256), "bfloat16")


def training_spec(replicas: int, tensor: int | None = 1, pipeline: int | None = 1, dtype: str = "bfloat16",
                  **training) -> ShardedModelSpec:
    parallelism = {"replicas": replicas, **({"tensor": tensor} if tensor else {}),
                   **({"pipeline": pipeline} if pipeline else {})}
    return ShardedModelSpec.model_validate({
        "model": {"uri": "/models/m"}, "workload": "training", "dtype": dtype, "parallelism": parallelism,
        "training": {"data": "/d.txt", "steps": 1, **training}, "checkpoint": {"claim": "c"}})


def nodes(count: int, memory_gib: float, gpus: int = 8) -> list[NodeInfo]:
    return [gpu_node(f"n{i:02d}", gpus, zone="z", rack="r", gpus=gpus, memory_gib=memory_gib) for i in range(count)]


def expected_memory(facts, tensor: int, pipeline: int, shard: int, spec: ShardedModelSpec) -> int:
    """The rule of docs/planner.md, written out here: per GPU of the worst stage, 16 bytes a parameter
    sharded over tensor x shard, two largest blocks gathered in the compute dtype, the stage's
    activations (activations.py, sized from the spec's seqLength; tested in test_planner_activations.py),
    1 GiB of CUDA overhead."""
    ranges, params = split_layers(facts, pipeline)
    worst = 0
    for i, p in enumerate(params):
        block = max(facts.layer_params, facts.embedding_params if i == 0 else 0,
                    facts.head_params if i == pipeline - 1 else 0)
        b = facts.bytes_per_param
        acts = stage_activation_bytes(facts, spec, max(2, b), tensor, ranges[i][1] - ranges[i][0], i, pipeline)
        need = 16 * p / (tensor * shard) + 2 * block * b / tensor + acts
        worst = max(worst, int(need + CUDA_OVERHEAD))
    return worst


# ------------------------------------------------------------------ the rule


def test_training_state_is_16_bytes_a_parameter_sharded_plus_two_gathered_blocks():
    params, block = 8_000_000_000, 500_000_000
    bf16 = training_state_bytes(LLAMA_8B, params, tensor=2, shard=4, block=block)
    assert bf16 == 16 * params / 8 + 2 * block * 2 / 2
    # float32 computes in the master weights themselves: only the gathered blocks grow (4 bytes)
    fp32 = training_state_bytes(LLAMA_8B.for_dtype("float32"), params, tensor=2, shard=4, block=block)
    assert fp32 - bf16 == 2 * block * (4 - 2) / 2


def test_the_sharded_state_falls_as_one_over_the_shard_degree():
    block = largest_unit(LLAMA_8B, True, True)
    gathered = training_state_bytes(LLAMA_8B, LLAMA_8B.params, 1, 10**12, block)   # ~ only the blocks left
    for shard in (1, 2, 4, 8, 16):
        state = training_state_bytes(LLAMA_8B, LLAMA_8B.params, 1, shard, block) - gathered
        assert state == pytest.approx(16 * LLAMA_8B.params / shard, rel=1e-6)
    # and in a plan: doubling the shard degree halves the sharded part of the memory per GPU
    per_gpu = {s: plan(training_spec(16, dataParallel={"shard": s}), LLAMA_8B, nodes(2, 10_000)).memory_per_gpu
               for s in (1, 2, 4, 8, 16)}
    for s in (1, 2, 4, 8):
        assert per_gpu[s] - per_gpu[2 * s] == pytest.approx(16 * LLAMA_8B.params / (2 * s), rel=1e-3)


def test_a_worked_number_llama_8b_on_80_gib():
    """docs/planner.md's example: Llama 3 8B in bfloat16, 8 replicas of one GPU each on 80 GiB GPUs."""
    result = plan(training_spec(8), LLAMA_8B, nodes(1, 80))
    assert result.data_shard == 2 and result.data_replicate == 4
    assert result.memory_per_gpu == expected_memory(LLAMA_8B, 1, 1, 2, training_spec(8))
    assert f"{result.memory_per_gpu / GiB:.1f}" == "63.2"
    assert "ZeRO-3 over 2 replica(s) (chosen) × 4 replicated: 63.2 GiB per GPU" in result.notes
    assert expected_memory(LLAMA_8B, 1, 1, 1, training_spec(8)) > 0.9 * 80 * GiB      # unsharded it would not fit


# ------------------------------------------------------------------ the shard degree


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replicas=st.integers(1, 24), memory_gib=st.sampled_from([24, 40, 48, 80, 141]),
       tensor=st.sampled_from([1, 2, 4, 8]), pipeline=st.sampled_from([1, 2, 4]),
       dtype=st.sampled_from(["bfloat16", "float32"]))
def test_the_chosen_shard_is_the_smallest_divisor_that_fits(replicas, memory_gib, tensor, pipeline, dtype):
    facts = LLAMA_8B.for_dtype(dtype)
    spec = training_spec(replicas, tensor, pipeline, dtype)
    inventory = nodes(replicas * pipeline * tensor // 8 + 1, memory_gib)
    divisors = [d for d in range(1, replicas + 1) if replicas % d == 0]       # brute force: every one
    fitting = [d for d in divisors if expected_memory(facts, tensor, pipeline, d, spec) <= 0.9 * memory_gib * GiB]
    if not fitting:   # not even sharded over every replica: the plan says how much it would need
        with pytest.raises(PlanError, match=f"{expected_memory(facts, tensor, pipeline, replicas, spec) / GiB:.1f} GiB per GPU"):
            plan(training_spec(replicas, tensor, pipeline, dtype), facts, inventory)
        return
    result = plan(training_spec(replicas, tensor, pipeline, dtype), facts, inventory)
    assert result.data_shard == fitting[0]
    assert result.memory_per_gpu == expected_memory(facts, tensor, pipeline, result.data_shard, spec)
    assert result.data_shard * result.data_replicate == result.replicas == replicas


@pytest.mark.parametrize("data_parallel, shard", [
    ({"shard": 4}, 4), ({"replicate": 2}, 4), ({"shard": 2, "replicate": 4}, 2), ({"shard": 8}, 8), ({"replicate": 8}, 1),
])
def test_a_shard_or_replicate_the_spec_gives_is_kept_even_when_less_would_fit(data_parallel, shard):
    result = plan(training_spec(8, dataParallel=data_parallel), LLAMA_8B, nodes(1, 10_000))
    assert (result.data_shard, result.data_replicate) == (shard, 8 // shard)
    assert f"ZeRO-3 over {shard} replica(s) (asked) × {8 // shard} replicated" in result.notes[1]
    # with nothing asked the planner would not shard at all on GPUs this large
    assert plan(training_spec(8), LLAMA_8B, nodes(1, 10_000)).data_shard == 1


def test_a_given_shard_that_does_not_fit_says_how_much_it_needs():
    with pytest.raises(PlanError, match=r"needs [0-9.]+ GiB per GPU at tensor 1 × pipeline 1"):
        plan(training_spec(8, dataParallel={"shard": 1}), LLAMA_8B, nodes(1, 80))


def test_sharding_comes_before_more_stages_or_a_larger_tensor_degree():
    """ZeRO-3 costs no GPUs: with tensor and pipeline left to the planner, 8 replicas of Llama 8B on
    80 GiB GPUs shard over 2 at one GPU a stage instead of taking 2 GPUs a replica."""
    result = plan(training_spec(8, tensor=None, pipeline=None), LLAMA_8B, nodes(1, 80))
    assert (result.tensor, result.pipeline, result.data_shard) == (1, 1, 2)
    alone = plan(training_spec(1, tensor=None, pipeline=None), LLAMA_8B, nodes(1, 80))
    assert alone.tensor * alone.pipeline > 1 and alone.data_shard == 1   # one replica has no one to shard with


def test_the_shard_degree_must_fit_enough_gpus_for_every_replica_not_just_the_largest():
    """One 141 GiB node holds 8 unsharded replicas (126.4 GiB each); 16 replicas also need the 80 GiB
    nodes, which hold them from shard 2 on."""
    big = [gpu_node("big", 8, zone="z", rack="r", memory_gib=141)]
    assert plan(training_spec(8), LLAMA_8B, big + nodes(2, 80)).data_shard == 1
    result = plan(training_spec(16), LLAMA_8B, big + nodes(2, 80))
    assert result.data_shard == 2 and result.replicas == 16


def test_when_nothing_fits_the_refusal_is_sized_at_sharding_over_every_replica():
    at_4 = expected_memory(LLAMA_8B, 1, 1, 4, training_spec(4)) / GiB                      # 36.6 GiB: the least it could need
    with pytest.raises(PlanError, match=f"needs {at_4:.1f} GiB per GPU at tensor 1 × pipeline 1; the largest GPUs have 24 GiB"):
        plan(training_spec(4, tensor=1, pipeline=1), LLAMA_8B, nodes(1, 24))


def test_serving_plans_shard_nothing():
    spec = ShardedModelSpec.model_validate({"model": {"uri": "/m"}, "parallelism": {"replicas": 4}})
    result = plan(spec, LLAMA_8B, nodes(4, 80))
    assert (result.data_shard, result.data_replicate) == (1, 4)
    assert not any("ZeRO-3" in n for n in result.notes)


def test_a_shrunk_training_plan_shards_over_a_divisor_of_what_fits():
    inventory = nodes(1, 80, gpus=3)   # 3 of the 4 replicas fit
    spec = training_spec(4)
    spec = spec.model_copy(update={"recovery": spec.recovery.model_copy(update={"allow_shrink": True})})
    result = plan(spec, LLAMA_8B, inventory)
    assert result.shrunk and result.replicas == 3
    assert result.replicas % result.data_shard == 0 and result.data_shard == 3
    assert result.memory_per_gpu == expected_memory(LLAMA_8B, 1, 1, 3, spec)


def test_compression_with_nothing_replicated_is_noted():
    # (80 GiB would not do: the error-feedback residual, 4 bytes a parameter over the 2 shards, is counted)
    result = plan(training_spec(2, gradientCompression={"method": "int8"}), LLAMA_8B, nodes(1, 141))
    assert result.data_replicate == 1
    assert any("training.gradientCompression int8 has nothing to compress" in n for n in result.notes)


@pytest.mark.parametrize("tensor, seq, note", [
    (2, 64, "sequence parallel: norms and activations between blocks split over the 2 tensor ranks (32 of 64 tokens each)"),
    (2, 63, "training.sequenceParallel cannot split seqLength 63 over tensor 2: the training pods will refuse to start"),
    (1, 64, "training.sequenceParallel has no effect: the layout has no tensor parallelism (tensor 1)"),
])
def test_sequence_parallelism_is_explained_against_the_tensor_degree(tensor, seq, note):
    result = plan(training_spec(2, tensor=tensor, sequenceParallel=True, seqLength=seq), LLAMA_8B, nodes(1, 80))
    assert any(note in n for n in result.notes), result.notes


# ------------------------------------------------------------------ refusals the spec cannot judge


def test_interleaved_micro_batches_must_be_a_multiple_of_the_stages_the_planner_chose():
    small = nodes(2, 24)     # one replica of Llama 8B at tensor 1 needs several stages here
    chosen = plan(training_spec(1, tensor=1, pipeline=None), LLAMA_8B, small)
    stages = chosen.pipeline
    assert stages > 1
    ok = plan(training_spec(1, tensor=1, pipeline=None, schedule="Interleaved1F1B", microBatches=2 * stages),
              LLAMA_8B, small)
    assert ok.pipeline == stages
    with pytest.raises(LayoutError) as e:
        plan(training_spec(1, tensor=1, pipeline=None, schedule="Interleaved1F1B", microBatches=2 * stages + 1),
             LLAMA_8B, small)
    assert str(e.value).startswith(f"training.microBatches {2 * stages + 1} is not a multiple of the {stages} "
                                   f"pipeline stages") and "\n" not in str(e.value)


def test_interleaved_needs_two_stages_a_pipeline_rank_within_the_layers():
    spec = training_spec(1, tensor=8, pipeline=20, schedule="Interleaved1F1B")
    with pytest.raises(LayoutError) as e:
        plan(spec, LLAMA_8B, nodes(20, 80))
    assert str(e.value) == ("training.schedule Interleaved1F1B needs 40 stages for 20 pipeline ranks, more than "
                            "the model's 32 layers; use 1F1B or GPipe")
    assert plan(training_spec(1, tensor=8, pipeline=16, schedule="Interleaved1F1B"), LLAMA_8B, nodes(16, 80)).pipeline == 16


@pytest.mark.parametrize("parallelism, message", [
    ({"tensor": 3}, "parallelism.tensor 3 does not divide the model's 32 attention heads; use one of 1, 2, 4, 8"),
    ({"tensor": 16}, "parallelism.tensor 16 does not divide the model's 8 KV heads; use one of 1, 2, 4, 8"),
    ({"pipeline": 40}, "parallelism.pipeline 40 exceeds the model's 32 layers; use 1 to 32"),
])
def test_degrees_the_model_refuses_are_one_line_naming_the_field(parallelism, message):
    """model.heads/layers unknown to the API server (read from the files): the planner judges, and
    the operator reports it as InvalidSpec."""
    spec = ShardedModelSpec.model_validate({"model": {"uri": "/m"}, "parallelism": parallelism})
    with pytest.raises(LayoutError) as e:
        plan(spec, LLAMA_8B, nodes(2, 80, gpus=16))
    assert str(e.value) == message
    node = {"metadata": {"name": "n0", "labels": {}}, "spec": {},
            "status": {"allocatable": {"nvidia.com/gpu": "16"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    with pytest.raises(planning.InvalidSpec, match=message.split(";")[0]):
        planning.plan_groups(spec, LLAMA_8B, "ns", "m", {"n0": node}, [], [0], None, [])


def test_a_layout_with_another_shard_degree_is_another_layout():
    result = plan(training_spec(4, dataParallel={"shard": 2}), LLAMA_8B, nodes(1, 10_000))
    assert planning.layout_matches(result, training_spec(4, dataParallel={"shard": 2}))
    assert planning.layout_matches(result, training_spec(4, dataParallel={"replicate": 2}))
    assert planning.layout_matches(result, training_spec(4))               # nothing asked: any degree
    assert not planning.layout_matches(result, training_spec(4, dataParallel={"shard": 4}))
    assert planning.layout_matches(result, training_spec(4, tensor=None, dataParallel={"shard": 2}))
