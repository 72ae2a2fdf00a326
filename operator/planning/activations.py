"""Training activations for the planner (pure, no torch): the bytes one GPU of a pipeline stage keeps
for backward, sized from the sequence length, in the manner of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") but with the constants of the worker's own
decoder (worker/model/llama.py), read off `torch.autograd.graph.saved_tensors_hooks` on a forward
of it (tests/worker/training/test_activation_memory.py checks them against that measurement).

Per token of one micro-batch and one decoder layer, p the compute dtype's bytes, h hidden, nq/nkv
query/KV heads, d = h/nq, I the MLP's intermediate size, what autograd saves is:

  each of the two RMSNorms (written out, or F.rms_norm on fp32) .. its input in fp32 (4h: the x.float()
      copy, on fp32 the input itself), its 1/rms in fp32 (4), the normalised x before the weight
      (p·h, for the weight's gradient) and its output, the input of the projections after it (p·h)
  attention ................. rotated q (p·nq·d), k and v (p·nkv·d each; on a GPU with nq > nkv
      causal_attention repeats them per query head first, so SDPA keeps p·nq·d each), SDPA's output
      (p·nq·d, also wo's input: the fused kernels return it in [B, T, heads, d] order, so the
      transpose-reshape is a view) and its log-sum-exp (fp32, 4·nq). No s x s matrix: SDPA's fused
      kernels (flash on CPU too) keep none. RoPE keeps only the shared cos/sin table (x·cos needs cos).
  SwiGLU ..................... w1's output (silu's input), silu's output, w3's output, w2's input
      (their product): 4·p·I
  residual adds .............. nothing

so 2·(4h + 4 + 2p·h) + p·d·(2nq + 2·kv) + 4nq + 4p·I bytes a token a layer (kv = nkv, or nq on a GPU).
On the tiny test model (h 64, 4/2 heads, I 128, fp32) that is 4,376 bytes: what the hooks measure.

Tensor parallel over T ranks splits heads and I; the norms run on every rank, or with sequence
parallelism on s/T tokens each (their input, 1/rms and normalised x), while the projections' inputs
are all-gathered back to the whole sequence and kept so. Context parallel over C ranks gives each
s/C tokens, except the keys and values attention all-gathers over the C ranks (worker/training/
context_parallel.py), kept for the whole sequence. Activation checkpointing keeps only each block's
input (p·h a token, /T under sequence parallelism), plus one block's full activations while it is
recomputed in backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.crds.modelshape import ModelFacts
from shardwise.crds.schedules import PipelineSchedule, default_micro_batches, virtual_stages

FP32 = 4


@dataclass(frozen=True)
class ActivationShape:
    """What sizes a stage's activations: the tokens a rank holds and how they are split."""
    seq: int                      # tokens per sequence (the whole sequence, before context parallel)
    micro_batch: int              # sequences per micro-batch
    compute_bytes: float          # bytes of the compute dtype (2: bf16, 4: fp32)
    tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1
    checkpointing: bool = False
    repeat_kv: bool = True        # keys/values repeated per query head before SDPA (the GPU path)


def layer_activation_bytes(facts: ModelFacts, a: ActivationShape) -> float:
    """Bytes one decoder layer keeps for backward for one micro-batch on one rank (see the module
    docstring for the terms); with checkpointing, only the block's input."""
    p, h, t = a.compute_bytes, facts.hidden, max(1, a.tensor)
    local = a.micro_batch * a.seq / max(1, a.context)           # tokens this rank holds
    split = t if a.sequence_parallel else 1
    if a.checkpointing:
        return local * p * h / split
    nq, d = facts.heads, facts.head_dim
    kv = nq if a.repeat_kv and nq > facts.kv_heads else facts.kv_heads
    norms = 2 * (FP32 * h + FP32 + p * h) / split + 2 * p * h
    attention = (p * d * 2 * nq + FP32 * nq) / t
    keys_values = a.micro_batch * a.seq * 2 * p * kv * d / t     # all-gathered over context parallel
    mlp = 4 * p * (facts.intermediate + facts.shared_intermediate) / t
    return local * (norms + attention + mlp) + keys_values


def full_layer_bytes(facts: ModelFacts, a: ActivationShape) -> float:
    """One layer's activations without checkpointing (what a checkpointed block holds while recomputed)."""
    return layer_activation_bytes(facts, ActivationShape(a.seq, a.micro_batch, a.compute_bytes, a.tensor,
                                                         a.sequence_parallel, a.context, False, a.repeat_kv))


def logits_bytes(facts: ModelFacts, a: ActivationShape) -> float:
    """The last stage's loss: its log-probabilities in fp32 (cross_entropy on logits.float()),
    vocab/T per token, and the final norm's terms."""
    local = a.micro_batch * a.seq / max(1, a.context)
    return local * (FP32 * facts.vocab / max(1, a.tensor) + FP32 * facts.hidden + FP32 + 2 * a.compute_bytes * facts.hidden)


def in_flight(schedule: str, pipeline: int, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once: GPipe runs every forward
    first (all of them); 1F1B up to P - stage (the first rank most); Interleaved1F1B's first rank
    about P + (P - 1)/v of its v virtual stages' worth (Korthikanti et al.'s 1 + (P-1)/(P·v))."""
    if pipeline <= 1:
        return 1
    if schedule == PipelineSchedule.GPIPE:
        return micro_batches
    warm = pipeline - stage
    if schedule == PipelineSchedule.INTERLEAVED_1F1B:
        warm += -(-(pipeline - 1 - stage) // virtual_stages(schedule))
    return max(1, min(micro_batches * virtual_stages(schedule), warm))


def micro_batching(spec, pipeline: int) -> tuple[int, int]:
    """(micro-batches per replica, sequences per micro-batch) of a training spec at `pipeline` stages:
    training.microBatches or the worker's default over the per-replica batch (batchSize over the
    data-parallel replicas, parallelism.replicas / contextParallel)."""
    t = spec.training
    context = spec.context_parallel()
    replicas = max(1, spec.parallelism.replicas // context)
    per_replica = max(1, t.batch_size // replicas)
    micro = t.micro_batches or default_micro_batches(pipeline, per_replica, t.schedule)
    return micro, max(1, -(-per_replica // micro))


def stage_activation_bytes(facts: ModelFacts, spec, compute_bytes: float, tensor: int, layers: int,
                           stage: int = 0, pipeline: int = 1) -> float:
    """Activation bytes one GPU of pipeline stage `stage` of `pipeline` keeps at its peak: its layers'
    (x micro-batches in flight), the stage input it keeps per micro-batch (the embedding's output
    on the first stage), the loss's log-probabilities on the last, and under checkpointing one
    block's full activations while it is recomputed."""
    t = spec.training
    micro, batch = micro_batching(spec, pipeline)
    a = ActivationShape(t.seq_length, batch, compute_bytes, tensor, t.sequence_parallel and tensor > 1,
                        spec.context_parallel(), t.activation_checkpointing)
    flight = in_flight(t.schedule, pipeline, micro, stage)
    split = tensor if a.sequence_parallel else 1
    stage_input = batch * a.seq / a.context * compute_bytes * facts.hidden / split
    per_micro = layers * layer_activation_bytes(facts, a) + stage_input
    last = logits_bytes(facts, a) * (micro if t.schedule == PipelineSchedule.GPIPE else 1) \
        if stage == pipeline - 1 else 0
    recompute = full_layer_bytes(facts, a) if a.checkpointing and layers else 0
    return flight * per_micro + last + recompute
