"""Training activations in the plan (operator/planning/activations.py): sized from seqLength, split by
context and sequence parallelism, cut by activation checkpointing, and a long sequence that no
longer fits one GPU. What the formula's constants are is measured in
tests/worker/training/test_activation_memory.py."""
from __future__ import annotations

import pytest

from shardwise.operator.planning.activations import (ActivationShape, in_flight, layer_activation_bytes,
                                                     stage_activation_bytes)
from shardwise.operator.planning.layouts import GiB, PlanError, stage_memory
from shardwise.operator.planning.planner import plan
from tests.operator.test_planner_zero import LLAMA_8B, nodes, training_spec


def activations(**training) -> float:
    spec = training_spec(1, **training)
    return stage_activation_bytes(LLAMA_8B, spec, 2, spec.parallelism.tensor or 1, LLAMA_8B.layers)


def test_doubling_the_sequence_raises_the_stage_memory_by_the_activations():
    short, long = training_spec(8, seqLength=4096), training_spec(8, seqLength=8192)
    grown = stage_memory(LLAMA_8B, long, 1, LLAMA_8B.params, LLAMA_8B.layers, 8) - \
        stage_memory(LLAMA_8B, short, 1, LLAMA_8B.params, LLAMA_8B.layers, 8)
    acts = stage_activation_bytes(LLAMA_8B, short, 2, 1, LLAMA_8B.layers)
    assert grown == pytest.approx(acts, rel=1e-6)       # linear in s: doubling adds as much again
    assert acts > 10 * GiB                              # 8B at 4096 tokens, one sequence a micro-batch


def test_context_parallel_halves_the_per_rank_activations_but_the_gathered_keys_and_values():
    facts = LLAMA_8B
    one = layer_activation_bytes(facts, ActivationShape(8192, 1, 2))
    two = layer_activation_bytes(facts, ActivationShape(8192, 1, 2, context=2))
    keys_values = 8192 * 2 * 2 * facts.heads * facts.head_dim          # the whole sequence's, repeated per head
    assert two == pytest.approx((one - keys_values) / 2 + keys_values)
    assert two < 0.6 * one


def test_sequence_parallel_divides_the_between_block_activations_by_t():
    plain = ActivationShape(4096, 1, 2, tensor=4)
    sp = ActivationShape(4096, 1, 2, tensor=4, sequence_parallel=True)
    h = LLAMA_8B.hidden
    between = 4096 * 2 * (4 * h + 4 + 2 * h)                 # the two norms' input, 1/rms, normalised x
    assert layer_activation_bytes(LLAMA_8B, plain) - layer_activation_bytes(LLAMA_8B, sp) == \
        pytest.approx(between * (1 - 1 / 4))
    ckpt = ActivationShape(4096, 1, 2, tensor=4, sequence_parallel=True, checkpointing=True)
    assert layer_activation_bytes(LLAMA_8B, ckpt) == 4096 * 2 * h / 4


def test_activation_checkpointing_keeps_the_block_inputs_and_one_block():
    full, kept = activations(seqLength=4096), activations(seqLength=4096, activationCheckpointing=True)
    block_input = 4096 * 2 * LLAMA_8B.hidden
    assert layer_activation_bytes(LLAMA_8B, ActivationShape(4096, 1, 2, checkpointing=True)) == block_input
    assert kept < full / 5
    one_block = layer_activation_bytes(LLAMA_8B, ActivationShape(4096, 1, 2))
    assert kept > LLAMA_8B.layers * block_input + one_block      # plus the stage input and the loss


def test_micro_batches_in_flight_follow_the_schedule():
    assert [in_flight("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("GPipe", 4, 8, s) for s in range(4)] == [8] * 4
    assert in_flight("1F1B", 4, 2, 0) == 2 and in_flight("1F1B", 1, 8, 0) == 1
    assert in_flight("Interleaved1F1B", 4, 8, 0) == 6 and in_flight("Interleaved1F1B", 4, 8, 3) == 1


def test_the_loss_is_the_largest_single_term_of_a_small_vocabulary_heavy_stage():
    spec = training_spec(1, seqLength=8192)
    last = stage_activation_bytes(LLAMA_8B, spec, 2, 1, 1, stage=3, pipeline=4)
    mid = stage_activation_bytes(LLAMA_8B, spec, 2, 1, 1, stage=2, pipeline=4)
    assert last - mid > 8192 * 4 * LLAMA_8B.vocab * 0.9 - mid      # fp32 log-probabilities, 4 GiB


def test_a_long_sequence_that_fit_one_gpu_now_shards_more():
    """8 replicas of Llama 8B on 80 GiB GPUs: at 64 tokens ZeRO-3 over 2 replicas is enough; at
    4096 tokens a sequence the activations need ZeRO-3 over 4; at 16384, with tensor and pipeline
    left to the planner, more GPUs a replica."""
    assert plan(training_spec(8), LLAMA_8B, nodes(1, 80)).data_shard == 2
    assert plan(training_spec(8, seqLength=4096), LLAMA_8B, nodes(1, 80)).data_shard == 4
    long = plan(training_spec(8, tensor=None, pipeline=None, seqLength=16384), LLAMA_8B, nodes(4, 80))
    assert long.tensor * long.pipeline > 1


def test_a_sequence_too_long_for_any_layout_is_refused_in_one_line():
    with pytest.raises(PlanError) as e:
        plan(training_spec(8, seqLength=65536), LLAMA_8B, nodes(1, 80))
    message = str(e.value)
    assert "\n" not in message and "GiB per GPU" in message
    assert "GiB of it are training activations (training.seqLength" in message, message
    # checkpointing and context parallelism make it fit (one sequence a step: the 8 ranks hold 1/8 each)
    fits = plan(training_spec(8, seqLength=65536, batchSize=1, activationCheckpointing=True, contextParallel=8), LLAMA_8B,
                nodes(1, 80))
    assert fits.context == 8
