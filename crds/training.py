"""spec.training: what a `workload: training` model trains on and how (Training), its data-parallel
layout (DataParallel) and gradient compression (GradientCompression), and the rules that tie
spec.training to spec.parallelism: CEL rules for the ShardedModelSpec (TRAINING_LAYOUT_RULES) and
their Python twin (check_layout), with the same words.

Importable from crds/models.py as well, with the rest of the API.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal, Optional

from pydantic import ConfigDict, Field, model_serializer, model_validator

from shardwise.crds import names
from shardwise.crds.apimodel import ApiModel, cel, malformed_pvc, pvc_rule
from shardwise.crds.schedules import DEFAULT_SCHEDULE, INTERLEAVED_MICRO_BATCHES, PipelineSchedule, micro_batches_fit

TRAINING_DATA_PVC = "training.data must look like pvc://<claim>/<path> when it starts with pvc://"

# Context parallelism: ranks one sequence is split over, at most (each is one replica of the job).
MAX_CONTEXT_PARALLEL = 64
CP_SEQUENCE = ("training.seqLength must be a multiple of 2 x training.contextParallel: each sequence is cut "
               "into 2 chunks per context-parallel rank")


def sequence_splits(seq_len: int, degree: int) -> bool:
    """Whether a sequence of `seq_len` tokens splits over `degree` context-parallel ranks: cut into
    2·degree equal chunks, rank i holding chunks i and 2·degree-1-i (the zigzag split that gives
    every rank the same causal-attention work; worker/training/context_parallel.py)."""
    return degree <= 1 or seq_len % (2 * degree) == 0


def sequence_problem(seq_len: int, degree: int) -> str | None:
    """Why a sequence length cannot be split over `degree` context-parallel ranks (one line), or None."""
    if sequence_splits(seq_len, degree):
        return None
    return (f"context parallelism splits each sequence into 2 x {degree} = {2 * degree} chunks: "
            f"sequence length {seq_len} is not a multiple of {2 * degree}")


class Precision(str, Enum):
    """The precision of the decoder blocks' matrix multiplications in training."""

    DEFAULT = "default"   # in the compute dtype (spec.dtype / --dtype): bf16 on GPU, what ran before fp8
    FP8 = "fp8"           # float8 (torchao, dynamic tensorwise scales); embedding, head, norms as DEFAULT


DEFAULT_PRECISION = Precision.DEFAULT
# float8 matmuls (torch._scaled_mm on CUDA) need both dimensions of every weight a multiple of 16,
# and so the tokens each rank multiplies (the inner dimension of the weight gradient's matmul).
FP8_MULTIPLE = 16


def float8_problem(matrices: dict[str, int], tokens: int) -> str | None:
    """Why fp8 cannot train these per-rank matrix dimensions (name -> size, after any tensor
    split) and `tokens` per micro-batch and rank (one line), or None."""
    bad = [f"{name} {size}" for name, size in matrices.items() if size % FP8_MULTIPLE]
    if tokens % FP8_MULTIPLE:
        bad.append(f"tokens per micro-batch {tokens}")
    if not bad:
        return None
    return (f"precision fp8 needs every matrix dimension a multiple of {FP8_MULTIPLE} (float8 matmuls): "
            f"{', '.join(bad)} per rank")


class DataParallel(ApiModel):
    """How the data-parallel replicas hold the model: ZeRO-3 (FSDP2) over `shard` of them, `replicate`
    copies of that averaged (HSDP). shard x replicate x training.contextParallel = spec.parallelism.replicas."""

    shard: Optional[int] = Field(None, ge=1, le=10000, description=(
        "Replicas that shard parameters, gradients and optimizer state among themselves (ZeRO-3). "
        "Must divide parallelism.replicas / contextParallel. Omitted: replicas / replicate, or with replicate omitted "
        "too, the smallest degree whose layout fits the GPUs' memory (the planner chooses)."))
    replicate: Optional[int] = Field(None, ge=1, le=10000, description=(
        "Copies of the sharded model whose gradients are averaged (HSDP). Must divide "
        "parallelism.replicas / contextParallel. Omitted: replicas / shard."))


class GradientCompression(ApiModel):
    """Compression of the gradients averaged between replicated copies (the replicate axis only)."""

    method: Literal[names.COMPRESSION_METHODS] = Field("none", description=(
        "none; int8, int4: quantized to 8 or 4 bits; topk: the largest `density` of the elements; topk-int4: those "
        "in 4 bits; powersgd: each matrix as a rank-`rank` product. What is not sent is carried over (error feedback)."))
    density: float = Field(0.01, gt=0, le=1, description="Fraction of the elements topk and topk-int4 send, in (0, 1].")
    warmup_steps: int = Field(0, ge=0, le=1000000, description=(
        "Steps uncompressed first; after them AdamW's variance is frozen (1-bit Adam). 0: none."))
    rank: int = Field(names.POWERSGD_DEFAULT_RANK, ge=1, le=names.POWERSGD_MAX_RANK,
                      description="powersgd: rank of each gradient matrix's approximation; bytes grow with it.")


class Training(ApiModel):
    """What a `workload: training` model trains on, and how. The layout (tensor x pipeline x
    replicas as data parallel) comes from the plan; checkpoints go to spec.checkpoint."""

    model_config = ConfigDict(json_schema_extra=cel(
        pvc_rule("data", TRAINING_DATA_PVC),
        ("!has(self.contextParallel) || self.contextParallel == 1 || !has(self.seqLength) || "
         "self.seqLength % (2 * self.contextParallel) == 0",
         CP_SEQUENCE, ".seqLength"),
    ))

    data: str = Field(min_length=1, max_length=4096, description=(
        "UTF-8 text to train on: a path inside the pod, or pvc://<claim>/<path> to mount a "
        "PersistentVolumeClaim read-only."))
    steps: int = Field(ge=1, description="Optimizer steps in all; a restarted job does only the rest.")
    batch_size: int = Field(8, ge=1, description="Sequences per step, over all data-parallel replicas.")
    seq_length: int = Field(64, ge=2, le=1048576, description="Tokens per sequence.")
    learning_rate: float = Field(3e-4, gt=0, le=10, description="AdamW learning rate (betas 0.9/0.95).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup.")
    weight_decay: float = Field(0.0, ge=0, le=1)
    seed: int = Field(0, ge=0, description="Data order and initial randomness: the batch of a step "
                                           "depends on the seed and the step only, in any layout.")
    micro_batches: Optional[int] = Field(None, ge=1, description=(
        "Pipeline micro-batches per replica; default: the largest divisor of the per-replica batch "
        "up to 2 x the pipeline stages (1 without a pipeline). Interleaved1F1B needs a multiple "
        "of the stages."))
    data_parallel: Optional[DataParallel] = Field(None, description=(
        "ZeRO-3 sharding across the data-parallel replicas; omitted: the planner chooses."))
    schedule: PipelineSchedule = Field(DEFAULT_SCHEDULE, description=(
        "Pipeline schedule: 1F1B, GPipe or Interleaved1F1B."))
    activation_checkpointing: bool = Field(False, description=(
        "Recompute each decoder block's activations in the backward pass instead of keeping them."))
    sequence_parallel: bool = Field(False, description=(
        "Tensor parallelism also splits norms and activations over the sequence (seqLength % T == 0)."))
    context_parallel: int = Field(1, ge=1, le=MAX_CONTEXT_PARALLEL, description=(
        "Context parallelism: each sequence split over this many ranks, which attend over the keys and "
        "values of the whole sequence. They are carved from the replicas: each replica (a tensor x "
        "pipeline group) holds 1/C of a sequence, so parallelism.replicas = dataParallel.shard x "
        "dataParallel.replicate x contextParallel, and C must divide the replicas. seqLength must be "
        "a multiple of 2 x C. 1: none."))
    precision: Precision = Field(DEFAULT_PRECISION, description=(
        "Precision of the decoder blocks' linear layers: default (the compute dtype, spec.dtype) or fp8 "
        "(float8 matmuls with dynamic tensorwise scales, float8 all-gather under FSDP; the embedding, head "
        "and norms stay in the compute dtype, master weights and optimizer state in fp32). fp8 needs the "
        "model's matrix dimensions (per tensor-parallel rank) and the tokens per micro-batch to be multiples of 16."))
    gradient_compression: Optional[GradientCompression] = Field(None, description=(
        "Compress the gradients averaged between replicated copies (dataParallel.replicate > 1)."))
    min_replicas: Optional[int] = Field(None, ge=1, le=10000, description=(
        "Elastic training: when the healthy GPUs cannot hold parallelism.replicas, run with the most "
        "replicas that fit, down to this many, and grow back when capacity returns. Omitted: "
        "parallelism.replicas (the job runs whole or waits). Must not exceed parallelism.replicas."))
    termination_grace_period_seconds: int = Field(120, ge=1, le=86400, description=(
        "The training pods' terminationGracePeriodSeconds: on SIGTERM (a restart to grow, a spec "
        "change, a drain) a rank saves a shared checkpoint and exits within this time."))

    @model_validator(mode="after")
    def _cross_checks(self) -> "Training":
        if malformed_pvc(self.data):
            raise ValueError(TRAINING_DATA_PVC)
        if not sequence_splits(self.seq_length, self.context_parallel):
            raise ValueError(f"{CP_SEQUENCE} (seqLength {self.seq_length}, contextParallel {self.context_parallel})")
        return self

    @model_serializer(mode="wrap")
    def _defaults_left_out(self, handler):
        # contextParallel left out at 1 (precision at its default likewise), so that a spec without it hashes as before (its pods do not roll) and a
        # worker image older than it still reads the pod contract.
        out = handler(self)
        if isinstance(out, dict) and self.context_parallel == 1:
            out.pop("context_parallel", None)
            out.pop("contextParallel", None)
        if isinstance(out, dict) and self.precision == DEFAULT_PRECISION:   # likewise
            out.pop("precision", None)
        return out


_DP = "self.training.dataParallel"
# spec.training against spec.parallelism. The API server's message is static (a messageExpression
# with string(int) is refused by the CRD cost estimator; format() needs Kubernetes 1.29+), so
# check_layout says the same words and adds the values in parentheses.
# Replicas 0 pauses a training job: shard x replicate may stay in the spec meanwhile. The C ranks of
# a sequence are replicas: replicas = shard x replicate x contextParallel.
_CP = "(has(self.training.contextParallel) ? self.training.contextParallel : 1)"
DP_PRODUCT = "training.dataParallel: shard x replicate x contextParallel must equal parallelism.replicas"
DP_DIVIDES = "training.dataParallel.{axis} x contextParallel must divide parallelism.replicas"
CP_DIVIDES = ("training.contextParallel must divide parallelism.replicas: the ranks of a sequence are "
              "replicas (tensor x pipeline groups)")
MIN_REPLICAS = "training.minReplicas must not exceed parallelism.replicas"
TRAINING_LAYOUT_RULES = (
    (f"!has(self.training) || !has({_DP}) || !has({_DP}.shard) || !has({_DP}.replicate) || "
     f"self.parallelism.replicas == 0 || {_DP}.shard * {_DP}.replicate * {_CP} == self.parallelism.replicas",
     DP_PRODUCT, ".training.dataParallel"),
    *((f"!has(self.training) || !has({_DP}) || !has({_DP}.{axis}) || "
       f"self.parallelism.replicas % ({_DP}.{axis} * {_CP}) == 0",
       DP_DIVIDES.format(axis=axis), f".training.dataParallel.{axis}") for axis in ("shard", "replicate")),
    (f"!has(self.training) || self.parallelism.replicas % {_CP} == 0", CP_DIVIDES, ".training.contextParallel"),
    ("!has(self.training) || !has(self.training.schedule) || self.training.schedule != 'Interleaved1F1B' || "
     "!has(self.training.microBatches) || !has(self.parallelism.pipeline) || "
     "self.training.microBatches % self.parallelism.pipeline == 0",
     INTERLEAVED_MICRO_BATCHES, ".training.microBatches"),
    ("!has(self.training) || !has(self.training.minReplicas) || self.parallelism.replicas == 0 || "
     "self.training.minReplicas <= self.parallelism.replicas", MIN_REPLICAS, ".training.minReplicas"),
)


def check_layout(t: Training, replicas: int, pipeline: Optional[int]) -> None:
    """TRAINING_LAYOUT_RULES in Python: the same words, and the values that break the rule."""
    dp, n, c = t.data_parallel, replicas, t.context_parallel
    cp = f" x contextParallel {c}" if c > 1 else ""
    if dp and dp.shard and dp.replicate and n and dp.shard * dp.replicate * c != n:
        raise ValueError(f"{DP_PRODUCT} (shard {dp.shard} x replicate {dp.replicate}{cp} = "
                         f"{dp.shard * dp.replicate * c}, replicas {n})")
    for axis, degree in (("shard", dp and dp.shard), ("replicate", dp and dp.replicate)):
        if degree and n % (degree * c):
            raise ValueError(f"{DP_DIVIDES.format(axis=axis)} ({axis} {degree}{cp}, replicas {n})")
    if n % c:
        raise ValueError(f"{CP_DIVIDES} (contextParallel {c}, replicas {n})")
    if not micro_batches_fit(t.schedule, pipeline, t.micro_batches):
        raise ValueError(f"{INTERLEAVED_MICRO_BATCHES} (microBatches {t.micro_batches}, "
                         f"pipeline {pipeline})")
    if t.min_replicas and n and t.min_replicas > n:
        raise ValueError(f"{MIN_REPLICAS} (minReplicas {t.min_replicas}, replicas {n})")
