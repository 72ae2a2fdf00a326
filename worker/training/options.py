"""What one training run is asked to do: TrainOptions (layout, schedule, checkpoint tiers,
optimizer, batch), the checks that a layout can train a model, and the options of a training pod
from its ShardPlan and pod contract."""
from __future__ import annotations

import os
from dataclasses import dataclass

from shardwise.crds import names
from shardwise.crds.layout import RankLayout
from shardwise.crds.modelsource import ModelUriError, parse_s3_uri
from shardwise.crds.training import DEFAULT_PRECISION, Precision, float8_problem, sequence_problem

from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch.s3 import S3Config
from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import parallelize as par
from shardwise.worker.training import schedules as pipe


@dataclass
class TrainOptions:
    model: str
    data: str
    checkpoint_dir: str
    steps: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1                   # ranks each sequence is split over (context_parallel.py)
    data_parallel: int = 1             # replicas in all: data_shard × replicate
    data_shard: int = 0                # ZeRO-3 shard degree; 0: all of data_parallel
    schedule: str = pipe.DEFAULT_SCHEDULE
    activation_checkpointing: bool = False
    prefetch_depth: int = 0            # FSDP2 blocks all-gathered ahead; 0: FSDP2's own order
    sequence_parallel: bool = False    # with tensor > 1: norms and activations between blocks split over the sequence
    compression: str = "none"          # on the replicate axis: none, int8, int4, topk, topk-int4, powersgd
    compression_density: float = 0.01  # topk, topk-int4: fraction of gradient elements sent
    compression_rank: int = names.POWERSGD_DEFAULT_RANK  # powersgd: rank of each gradient matrix's approximation
    compression_warmup: int = 0        # dense AdamW steps first, then the variance frozen (frozen_adam.py)
    checkpoint_every: int = 0          # 0: only at the end
    checkpoint_uri: str | None = None  # s3://bucket/prefix: the shared tier in an object store
    checkpoint_s3: S3Config = S3Config()   # its endpoint, region, path style
    # the prefix of the environment variables its credentials are read under: "" (AWS_ACCESS_KEY_ID,
    # ...) for `shardwise train`, crds.names.CHECKPOINT_CREDENTIAL_PREFIX in a pod
    checkpoint_env_prefix: str = ""
    keep: int = 3
    local_checkpoint_dir: str | None = None   # node-local tier: each rank's own state, no collective
    local_every: int = 0               # 0: no local tier
    local_keep: int = 2                # local checkpoints kept per rank
    seed: int = 0
    lr: float = 3e-4
    warmup: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 8                # global: sequences per step over all replicas
    seq_len: int = 64
    micro_batches: int = 0             # per replica; 0: stages.default_micro_batches
    device: str = "cpu"
    dtype: str = "float32"             # compute dtype; master weights and optimizer state are fp32
    # the decoder blocks' matmuls: in `dtype`, or fp8 (torchao float8; parallelize.apply_float8)
    precision: Precision = DEFAULT_PRECISION
    async_checkpoint: bool = True
    json: bool = False
    stage_layers: list[tuple[int, int]] | None = None   # from a ShardPlan; None: the planner's split

    @property
    def shard(self) -> int:
        return self.data_shard or self.data_parallel

    @property
    def mesh_shape(self) -> par.MeshShape:
        return par.MeshShape(max(1, self.data_parallel // self.shard), self.shard, self.pipeline, self.tensor,
                             self.context)

    @property
    def layout(self) -> RankLayout:
        """Training is one world over all replicas: RankLayout's replicas are the data-parallel
        replicas times the context-parallel ranks of each (parallelize.py's mesh order)."""
        return self.mesh_shape.layout

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def micro_batches_per_replica(self) -> int:
        return self.micro_batches or pipe.default_micro_batches(self.pipeline, self.batch_size // self.data_parallel,
                                                                self.schedule)

    def problem(self, layers: int) -> str | None:
        """Why these options cannot train a model of `layers` layers (one line), or None."""
        D, S = self.data_parallel, self.shard
        if D % S:
            return f"data-parallel shard degree {S} does not divide the {D} data-parallel replicas"
        if self.batch_size % D:
            return f"batch size {self.batch_size} does not split evenly into {D} data-parallel replicas"
        if self.compression != "none" and not 0 < self.compression_density <= 1:
            return f"compression density must be in (0, 1], got {self.compression_density}"
        if self.compression != "none" and not 1 <= self.compression_rank <= names.POWERSGD_MAX_RANK:
            return f"compression rank must be 1 to {names.POWERSGD_MAX_RANK}, got {self.compression_rank}"
        if not 0 <= self.prefetch_depth <= 8:
            return f"prefetch depth must be 0 to 8 blocks, got {self.prefetch_depth}"
        if self.compression_warmup < 0:
            return f"compression warm-up must be 0 or more steps, got {self.compression_warmup}"
        problem = sequence_problem(self.seq_len, self.context)   # the zigzag split (context_parallel.py)
        if problem:
            return problem
        local = self.seq_len // self.context     # the tokens of a sequence each context-parallel rank holds
        if self.sequence_parallel and self.tensor > 1 and local % self.tensor:
            held = f"sequence length {self.seq_len}" if self.context == 1 else \
                f"the {local} tokens of a sequence each of the {self.context} context-parallel ranks holds"
            return (f"sequence parallelism splits each sequence over the {self.tensor} tensor-parallel ranks: "
                    f"{held} is not a multiple of {self.tensor}")
        micro = self.micro_batches_per_replica()
        if self.pipeline > 1:
            problem = pipe.check_schedule(self.schedule, self.pipeline, micro, layers)
            if problem:
                return problem
        if (self.batch_size // D) % micro:
            return (f"per-replica batch {self.batch_size // D} does not split evenly into {micro} "
                    f"micro-batches")
        return None


def precision_problem(opts: TrainOptions, config) -> str | None:
    """Why `opts.precision` cannot train a model of `config` (a ModelConfig) in this layout (one
    line), or None: fp8's float8 matmuls need each rank's matrix dimensions (the column-split ones
    divided by the tensor degree) and tokens per micro-batch to be multiples of 16."""
    if opts.precision != Precision.FP8:
        return None
    T, head = opts.tensor, config.head_dim
    matrices = {"hidden size": config.hidden_size, "attention width": config.num_heads * head // T,
                "key/value width": config.num_kv_heads * head // T, "MLP width": config.intermediate_size // T}
    per_replica = opts.batch_size // opts.data_parallel
    tokens = per_replica // opts.micro_batches_per_replica() * (opts.seq_len // opts.context)
    return float8_problem(matrices, tokens)


def shared_store(opts: TrainOptions, field: str = "--checkpoint-uri"):
    """Where the shared tier is kept: the object store of `checkpoint_uri`, else the folder
    `checkpoint_dir` (a claim). WorkerError (one line, naming `field`) for a malformed uri."""
    if not opts.checkpoint_uri:
        return ckpt.ClaimStore(opts.checkpoint_dir)
    from shardwise.worker.training.checkpoint_s3 import S3CheckpointStore
    try:
        uri = parse_s3_uri(opts.checkpoint_uri, field)
    except ModelUriError as e:
        raise WorkerError(str(e)) from None
    prefix = opts.checkpoint_env_prefix
    env = {k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)} if prefix else None
    return S3CheckpointStore(uri, opts.checkpoint_s3, env=env)


def layout_record(opts: TrainOptions) -> dict:
    """The layout as a checkpoint's meta.json records it (the context degree only when there is
    one, so that the record of a layout without it, a local checkpoint's fingerprint, is unchanged)."""
    record = {"tensor": opts.tensor, "pipeline": opts.pipeline, "data_parallel": opts.data_parallel,
              "data_shard": opts.shard, "schedule": opts.schedule}
    return record | ({"context": opts.context} if opts.context > 1 else {})


# ---------------------------------------------------------------- pods: training from a ShardPlan

def options_from_plan(plan, *, model: str, data: str, steps: int, checkpoint_dir: str,
                      **more) -> TrainOptions:
    """Training options for a ShardedModel's pods: the layout (T, P, replicas as DP x CP) and each
    stage's layer range come from the plan; the rest from the spec (passed as keywords with
    TrainOptions' names, e.g. checkpoint_every=100, lr=1e-4)."""
    stages = plan.stages_of(0) if plan.placements else []
    layers = [(p.layer_start, p.layer_end) for p in stages] or None
    # The plan's replicas are C ranks per sequence x the data-parallel replicas, and its ZeRO-3
    # degree counts replicas too (dp_shard x cp): MeshShape's order, so a pod's rank is the same.
    context = plan.context
    return TrainOptions(model=model, data=data, steps=steps, checkpoint_dir=checkpoint_dir,
                        tensor=plan.tensor, pipeline=plan.pipeline, context=context,
                        data_parallel=max(1, plan.replicas // context), data_shard=plan.data_shard // context,
                        stage_layers=layers, **more)


def pod_rank(replica: int, stage: int, local_rank: int, plan) -> int:
    """The global training rank of a GPU in a pod (torchrun --node-rank = replica*P + stage)."""
    return RankLayout(plan.tensor, plan.pipeline, max(1, plan.replicas)).rank(replica, stage, local_rank)


def options_from_contract(contract, *, device: str, dtype: str) -> TrainOptions:
    """TrainOptions of a training pod, from its pod contract (crds/contract.py): the one mapping
    from spec.training and spec.checkpoint to TrainOptions' names. `device` and `dtype` are what
    the pod resolved (the contract's dtype may be auto)."""
    t, c = contract.training, contract.checkpoint
    local = c.local   # spec.checkpoint.local: the node-local tier, or None
    return options_from_plan(
        contract.plan, model=contract.model.path, data=t.data, steps=t.steps, checkpoint_dir=c.path,
        checkpoint_every=c.interval_steps, keep=c.keep, seed=t.seed, lr=t.learning_rate,
        warmup=t.warmup_steps, weight_decay=t.weight_decay, batch_size=t.batch_size, seq_len=t.seq_length,
        micro_batches=t.micro_batches or 0, schedule=t.schedule.value, precision=t.precision,
        activation_checkpointing=t.activation_checkpointing, sequence_parallel=t.sequence_parallel,
        compression=t.gradient_compression.method if t.gradient_compression else "none",
        compression_density=t.gradient_compression.density if t.gradient_compression else 0.01,
        compression_warmup=t.gradient_compression.warmup_steps if t.gradient_compression else 0,
        compression_rank=t.gradient_compression.rank if t.gradient_compression else names.POWERSGD_DEFAULT_RANK,
        checkpoint_uri=c.uri, checkpoint_s3=S3Config(endpoint=c.endpoint, region=c.region or S3Config().region,
                                                     path_style=bool(c.path_style)),
        checkpoint_env_prefix=names.CHECKPOINT_CREDENTIAL_PREFIX,
        local_checkpoint_dir=local.path if local else None, local_every=local.interval_steps if local else 0,
        local_keep=local.keep if local else 2, device=device, dtype=dtype, json=True)
