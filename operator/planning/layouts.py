"""Layouts and their memory, for the planner (pure): which tensor x pipeline layouts hold a model,
and how many bytes one GPU of a stage needs under each.

Memory per GPU = weights/TP + KV cache + activations (inference), or the ZeRO-3 training state of
training_state_bytes, the error-feedback residual of gradient compression and the activations of
activations.py, sized from the sequence length and micro-batches in flight (training), + a fixed
CUDA overhead, against 90% of the GPU's memory. Layouts are tried smallest tensor degree first at pipeline 1, then the fewest stages that fit
(largest tensor first); a training job's schedule may rule some out (fit_schedule). Weights are sized
in the dtype the worker holds them in on a GPU, or as spec.serving.quantization holds them
(ModelFacts.quantized), and a streaming plan's resident share is offload_budget.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from shardwise.crds.layout import split_layers
from shardwise.crds.models import ShardedModelSpec, Workload
from shardwise.crds.names import MAX_PIPELINE
from shardwise.crds.modelshape import ModelFacts
from shardwise.crds.plan import StagePlacement
from shardwise.crds.schedules import micro_batches_fit, virtual_stages
from shardwise.crds.training import Precision
from shardwise.operator.planning.activations import stage_activation_bytes
from shardwise.operator.planning.inventory import NodeInfo

GiB = 2**30
CUDA_OVERHEAD = 1 * GiB          # context, cuBLAS workspace, NCCL buffers per GPU
USABLE_FRACTION = 0.90           # of a GPU's memory the planner fills
ACTIVATION_FRACTION = 0.10       # inference activations as a share of the rank's weights
# ZeRO-3 (FSDP2) with mixed precision, bytes per parameter, sharded over tensor x shard ranks:
MASTER_BYTES = 4                 # fp32 master weights (on float32 the weights themselves)
GRADIENT_BYTES = 4               # fp32 gradients (reduced in fp32)
ADAM_BYTES = 8                   # the two fp32 AdamW moments
BLOCKS_IN_FLIGHT = 2             # unsharded: the block FSDP gathered and the next one, prefetched
FP8_GATHERED_BYTES = 1           # training.precision fp8: a decoder layer all-gathered in float8
RESIDUAL_BYTES = 4               # gradient compression's error feedback: an fp32 gradient shard


class PlanError(ValueError):
    """Nothing fits; str(error) is one sentence saying why. More capacity may fix it."""


class Deadline:
    """The time a plan may take (PLAN_SECONDS): a search past it ends in a PlanError saying so, so a
    spec whose search is long cannot hold the capacity lock (plans are made one at a time)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds if seconds else None

    def check(self) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise PlanError(f"no plan found within {self.seconds:g} s of search; give parallelism.tensor "
                            f"and parallelism.pipeline, or check the model's size")


PLAN_SECONDS = 10.0


class LayoutError(PlanError):
    """The layout asked for cannot hold the model at all, or the spec asks for what this model
    cannot have (quantization gguf of a model not stored as Q8_0, Q4_0 or Q4_1): no amount of
    capacity fixes it."""


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    memory: int                   # bytes per GPU, worst stage
    ranges: tuple[tuple[int, int], ...]
    stage_params: tuple[int, ...]
    shard: int = 1                # training: ZeRO-3 shard degree the memory is sized at
    activations: int = 0          # training: bytes of `memory` that are activations (activations.py)


def activation_bytes(facts: ModelFacts) -> float:
    """Bytes per KV-cache and activation element: quantized weights still compute in 16 bits."""
    return max(2.0, facts.bytes_per_param) if facts.bytes_per_param <= 4 else 4.0


def weight_bytes(facts: ModelFacts, params: int, tensor: int) -> float:
    """Bytes of weights one GPU of a stage holding `params` parameters keeps, once loaded."""
    return params * facts.bytes_per_param / tensor


def training_state_bytes(facts: ModelFacts, params: int, tensor: int, shard: int, block: int,
                         fp8: bool = False) -> float:
    """Bytes of training state one GPU of a stage holding `params` parameters keeps under ZeRO-3.

    Sharded over its `tensor` ranks and the `shard` data-parallel replicas: fp32 master weights,
    fp32 gradients and both fp32 AdamW moments, 16 bytes a parameter. Unsharded, in the compute
    dtype (bytes_per_param): the blocks in flight - FSDP all-gathers one block (a decoder layer,
    or the embedding or LM head, `block` parameters) while prefetching the next, and frees them
    after use. On float32 the master weights are the weights: no other copy is kept or counted.

    `fp8` (training.precision fp8, torchao's tensorwise recipe): the sharded state is unchanged (fp32
    master weights, gradients and moments: float8 is only the matmuls' operands). What shrinks is the
    gathered buffer when the largest unit is a decoder layer and FSDP shards (shard > 1): FSDP2 then
    all-gathers the layer's weights already in float8, FP8_GATHERED_BYTES a parameter instead of the
    compute dtype's (the norms' few weights stay in it and are not told apart). Not counted: with
    shard 1 no float8 all-gather runs (the bf16 gathered copy stays, plus a transient float8 cast per
    matmul, small beside it, left to the headroom); an embedding or head unit, never converted, keeps
    the compute dtype; activations are unchanged (Float8Linear keeps its high-precision input for
    backward, so no saving is claimed).
    """
    sharded = (MASTER_BYTES + GRADIENT_BYTES + ADAM_BYTES) * params / (tensor * shard)
    per_param = facts.bytes_per_param
    if fp8 and shard > 1 and block <= facts.layer_params:
        per_param = min(per_param, FP8_GATHERED_BYTES)
    gathered = BLOCKS_IN_FLIGHT * block * per_param / tensor
    return sharded + gathered


def largest_unit(facts: ModelFacts, embedding: bool, head: bool) -> int:
    """Parameters of a stage's largest FSDP unit: a decoder layer, the embedding, the LM head."""
    return max(facts.layer_params, facts.embedding_params if embedding else 0, facts.head_params if head else 0)


def compression_residual_bytes(spec: ShardedModelSpec, params: int, tensor: int, shard: int) -> float:
    """Gradient compression's error feedback: what was not sent, carried to the next step, an fp32
    tensor the size of the rank's gradient shard (RESIDUAL_BYTES over tensor x shard ranks). PowerSGD's
    bases (rank x a matrix's side, per matrix) are small beside it and not counted."""
    gc = spec.training.gradient_compression if spec.training else None
    return RESIDUAL_BYTES * params / (tensor * shard) if gc and gc.method != "none" else 0.0


def stage_memory(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, params: int, layers: int,
                 shard: int = 1, block: int = 0, stage: int = 0, pipeline: int = 1) -> int:
    """Bytes one GPU of a stage needs: its slice of the weights (training: of the ZeRO-3 state over
    `shard` replicas, `block` the largest unit it gathers, and the activations of stage `stage` of
    `pipeline`; a stage past the last has the fewest micro-batches in flight and no loss) plus headroom."""
    weights = weight_bytes(facts, params, tensor)
    if spec.workload == Workload.TRAINING:
        fp8 = spec.training is not None and spec.training.precision == Precision.FP8
        state = training_state_bytes(facts, params, tensor, shard, block or facts.layer_params, fp8)
        residual = compression_residual_bytes(spec, params, tensor, shard)
        acts = stage_activation_bytes(facts, spec, activation_bytes(facts), tensor, layers, stage, pipeline)
        need = state + residual + acts
    else:
        kv = spec.serving.kv_cache_tokens * layers * facts.kv_bytes_per_token_per_layer(activation_bytes(facts))
        if spec.serving.offload:
            # layers beyond two stream through two slots (worker/weights/offload.py): the GPU holds the
            # stage's weights outside its layers and two layers' worth
            weights = min(weights, weight_bytes(facts, params - max(0, layers - 2) * facts.layer_params, tensor))
        need = weights + kv / tensor + ACTIVATION_FRACTION * weights
    return int(need + CUDA_OVERHEAD)


def asked_shard(spec: ShardedModelSpec) -> int | None:
    """The ZeRO-3 shard degree spec.training.dataParallel fixes, in replicas: shard x contextParallel
    (FSDP shards over dp_shard x cp), or replicas / replicate."""
    dp = spec.training.data_parallel if spec.workload == Workload.TRAINING and spec.training else None
    replicas, context = spec.parallelism.replicas, spec.context_parallel()
    if dp is None or replicas == 0 or not (dp.shard or dp.replicate):
        return None
    shard = dp.shard * context if dp.shard else replicas // dp.replicate
    replicate = dp.replicate or (replicas // shard if shard else 0)   # (replicate > replicas: shard 0)
    if shard * replicate != replicas or shard % context:   # the API refuses it; a spec built in code may not be checked
        cp = f" with training.contextParallel {context}" if context > 1 else ""
        raise LayoutError(f"training.dataParallel (shard {dp.shard}, replicate {dp.replicate}) does not "
                          f"split parallelism.replicas {replicas}{cp}")
    return shard


def shard_degrees(spec: ShardedModelSpec) -> list[int]:
    """ZeRO-3 shard degrees a layout may be sized at, least sharded first: the spec's, else every
    divisor of the replicas that is a multiple of the context-parallel degree (the ranks of a
    sequence always shard among themselves; more sharding, more communication). [1] when not training."""
    replicas, context = spec.parallelism.replicas, spec.context_parallel()
    fixed = asked_shard(spec)
    if fixed or spec.workload != Workload.TRAINING or replicas < 2:
        return [fixed or context]
    return [d for d in _divisors(replicas) if d % context == 0] or [context]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _worst_stage(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, ranges: Sequence[tuple[int, int]],
                 params: Sequence[int], shard: int) -> int:
    last = len(ranges) - 1
    return max(stage_memory(facts, spec, tensor, p, e - s, shard, largest_unit(facts, i == 0, i == last), i, last + 1)
               for i, (p, (s, e)) in enumerate(zip(params, ranges)))


def make_layout(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, pipeline: int,
                roomy: Callable[[int], bool] | None = None) -> Layout:
    """The layout's layer split and worst-stage memory. Training: at the least-sharded ZeRO-3
    degree whose memory `roomy` accepts (memory falls as the degree grows: a binary search), the
    most sharded when none is, the least when there is no `roomy` to ask."""
    try:
        ranges, params = split_layers(facts, pipeline)
    except ValueError as e:  # more stages than layers: no capacity makes that fit
        raise LayoutError(str(e)) from None
    degrees = shard_degrees(spec)
    lo, hi = 0, len(degrees) - 1 if roomy else 0
    while lo < hi:
        mid = (lo + hi) // 2
        if roomy(_worst_stage(facts, spec, tensor, ranges, params, degrees[mid])):
            hi = mid
        else:
            lo = mid + 1
    memory = _worst_stage(facts, spec, tensor, ranges, params, degrees[lo])
    return Layout(tensor, pipeline, memory, ranges, params, degrees[lo], _worst_activations(facts, spec, tensor, ranges))


def _worst_activations(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, ranges: Sequence[tuple[int, int]]) -> int:
    if spec.workload != Workload.TRAINING:
        return 0
    return int(max(stage_activation_bytes(facts, spec, activation_bytes(facts), tensor, e - s, i, len(ranges))
                   for i, (s, e) in enumerate(ranges)))


def fits(memory: int, node: NodeInfo) -> bool:
    return node.gpu_memory == 0 or memory <= node.gpu_memory * USABLE_FRACTION


def stage_memory_floor(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, pipeline: int) -> int:
    """A lower bound of make_layout(...).memory, in O(1): some stage holds at least ceil(layers /
    pipeline) layers (their parameters and KV cache; training: sized as a stage past the last, with
    the fewest micro-batches in flight), the first stage the embedding and a layer, the last the LM
    head and a layer; training at the most sharded ZeRO-3 degree. stage_memory grows with
    a stage's parameters and layers, so each is at most the worst stage's memory."""
    per, most = facts.layer_params, -(-facts.layers // pipeline)
    shard = shard_degrees(spec)[-1]
    return max(stage_memory(facts, spec, tensor, params, layers, shard, per, stage, pipeline)
               for params, layers, stage in ((most * per, most, pipeline), (facts.embedding_params + per, 1, 0),
                                             (facts.head_params + per, 1, pipeline - 1)))


def _first_depth(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, deepest: int,
                 fits_some: Callable[[int], bool]) -> int:
    """The fewest stages whose memory floor fits some node (deepest when none does): no fewer can
    fit, and the floor falls as stages are added, so a binary search finds it."""
    if not fits_some(stage_memory_floor(facts, spec, tensor, deepest)):
        return deepest
    lo, hi = 1, deepest
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits_some(stage_memory_floor(facts, spec, tensor, mid)) else (mid + 1, hi)
    return lo


def candidate_layouts(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo],
                      deadline: Deadline | None = None) -> list[Layout]:
    """Layouts to try, most preferred first (see the module docstring). Depths whose memory floor
    fits no node are skipped (the same layouts as trying each depth in turn, without the work)."""
    deadline = deadline or Deadline(None)
    largest_block = max((n.free for n in nodes), default=0)
    memories = [n.gpu_memory for n in nodes if n.gpu_memory] or [0]
    largest_memory = max(memories)

    def fits_some(layout: Layout) -> bool:
        return any(n.free >= layout.tensor and fits(layout.memory, n) for n in nodes)

    def floor_fits(tensor: int) -> Callable[[int], bool]:
        return lambda memory: any(n.free >= tensor and fits(memory, n) for n in nodes)

    def roomy(tensor: int, pipeline: int) -> Callable[[int], bool]:
        """Training's shard degree: enough free GPUs hold `memory` for every replica's stages."""
        need = max(1, spec.parallelism.replicas) * pipeline
        return lambda memory: sum(n.free // tensor for n in nodes if fits(memory, n)) >= need

    if spec.parallelism.tensor:
        tensors = [spec.parallelism.tensor]
    else:
        tensors = [t for t in range(1, max(1, largest_block) + 1) if facts.tensor_fits(t)]
    if spec.parallelism.pipeline:
        return [make_layout(facts, spec, t, spec.parallelism.pipeline, roomy(t, spec.parallelism.pipeline)) for t in tensors]
    single, multi = [], []
    for t in tensors:
        # fewest stages whose worst stage fits the largest GPU (memory falls roughly as 1/stages);
        # ZeRO-3 sharding costs no GPUs, so a training layout shards more before it adds stages
        deepest = min(facts.layers, MAX_PIPELINE)
        pp = 1 if largest_memory == 0 else _first_depth(facts, spec, t, deepest, floor_fits(t))
        while True:
            deadline.check()
            layout = make_layout(facts, spec, t, pp, roomy(t, pp))
            if largest_memory == 0 or fits_some(layout) or pp >= deepest:
                break
            pp += 1
        (single if pp == 1 else multi).append(layout)
    return single + sorted(multi, key=lambda l: (l.pipeline, -l.tensor))


def offload_budget(spec: ShardedModelSpec, facts: ModelFacts, layout: Layout, gpus: Sequence[NodeInfo]) -> int:
    """Bytes of weights each GPU of a streaming plan may keep resident: what the smallest GPU placed
    on leaves after the worst stage's KV cache, the CUDA overhead and activations (stage_memory's
    terms, solved for the weights)."""
    usable = min(n.gpu_memory for n in gpus if n.gpu_memory) * USABLE_FRACTION
    layers = max(e - s for s, e in layout.ranges)
    kv = spec.serving.kv_cache_tokens * layers * facts.kv_bytes_per_token_per_layer(activation_bytes(facts))
    return max(0, int((usable - kv / layout.tensor - CUDA_OVERHEAD) / (1 + ACTIVATION_FRACTION)))


def check_layout(spec: ShardedModelSpec, facts: ModelFacts) -> None:
    """The degrees the spec names must fit the model's heads and layers, whatever the capacity:
    one line naming the spec's field and what would work."""
    if spec.parallelism.expert and not facts.experts:
        raise LayoutError(f"parallelism.expert {spec.parallelism.expert} is for mixture-of-experts models; "
                          f"this model has no experts (use parallelism.tensor)")
    if spec.parallelism.tensor:
        for name, count in (("attention heads", facts.heads), ("KV heads", facts.kv_heads),
                            ("experts (expert parallel splits them over the tensor group)", facts.experts),
                            ("shared expert width (intermediate size, split like a dense MLP)", facts.shared_intermediate)):
            if count and count % spec.parallelism.tensor:
                fitting = ", ".join(map(str, _divisors(math.gcd(facts.heads, facts.kv_heads, facts.experts,
                                                                facts.shared_intermediate))))
                raise LayoutError(f"parallelism.tensor {spec.parallelism.tensor} does not divide the model's "
                                  f"{count} {name}; use one of {fitting}")
    if spec.parallelism.pipeline and spec.parallelism.pipeline > facts.layers:
        raise LayoutError(f"parallelism.pipeline {spec.parallelism.pipeline} exceeds the model's "
                          f"{facts.layers} layers; use 1 to {facts.layers}")
    asked_shard(spec)   # a dataParallel that does not split the replicas (a spec the API did not check)
    context = spec.context_parallel()
    if spec.parallelism.replicas % context:   # the API refuses it; elastic sizes are multiples of it
        raise LayoutError(f"training.contextParallel {context} does not divide parallelism.replicas "
                          f"{spec.parallelism.replicas}: the ranks of a sequence are replicas")


def fit_schedule(spec: ShardedModelSpec, facts: ModelFacts, layouts: list[Layout]) -> list[Layout]:
    """The layouts the training schedule can run (crds/schedules.py): Interleaved1F1B cuts the model
    into 2 stages per pipeline rank, so 2 x pipeline <= layers, and runs a multiple of the pipeline
    degree as micro-batches (training.microBatches, when given). Pipeline 1 runs as 1F1B."""
    t = spec.training if spec.workload == Workload.TRAINING else None
    if t is None or not layouts:
        return layouts
    per_rank = virtual_stages(t.schedule)
    fitting = [layout for layout in layouts if layout.pipeline == 1 or (
        per_rank * layout.pipeline <= facts.layers
        and micro_batches_fit(t.schedule, layout.pipeline, t.micro_batches))]
    p = layouts[0].pipeline
    if not fitting and per_rank * p > facts.layers:
        raise LayoutError(f"training.schedule Interleaved1F1B needs {per_rank * p} stages for "
                          f"{p} pipeline ranks, more than the model's {facts.layers} layers; use 1F1B or GPipe")
    if not fitting:
        raise LayoutError(f"training.microBatches {t.micro_batches} is not a multiple of the {p} pipeline stages "
                          f"the model needs; schedule Interleaved1F1B needs that: set microBatches to a "
                          f"multiple of {p}, or parallelism.pipeline")
    return fitting


def layouts_to_try(spec: ShardedModelSpec, facts: ModelFacts, pool, kept: dict[int, list[StagePlacement]],
             wanted: int, deadline: Deadline | None = None) -> list[Layout]:
    """The layouts to try, most preferred first: the kept replicas' own, else the candidates."""
    if kept:
        first = next(iter(kept.values()))
        return [make_layout(facts, spec, first[0].gpus, len(first))]
    if wanted == 0 and not pool.nodes:
        return [make_layout(facts, spec, spec.parallelism.tensor or 1, spec.parallelism.pipeline or 1)]
    if not pool.nodes:
        raise PlanError(f"no node can run it ({pool.why_not()})" if pool.excluded else "the inventory has no nodes")
    layouts = candidate_layouts(spec, facts, pool.nodes, deadline)
    if not layouts:
        raise LayoutError(f"no tensor degree up to the largest free block of "
                          f"{max(n.free for n in pool.nodes)} GPUs divides the model's "
                          f"{facts.heads} attention and {facts.kv_heads} KV heads"
                          + (f" and {facts.experts} experts" if facts.experts else ""))
    return fit_schedule(spec, facts, layouts)


def sharded(spec: ShardedModelSpec, facts: ModelFacts, layout: Layout, replicas: int) -> Layout:
    """The layout at a shard degree dividing the replicas planned: a plan shrunk to replicas its
    degree does not divide takes the least-sharded divisor at least as sharded (and a multiple of
    the context-parallel degree), else all of them."""
    if replicas % layout.shard == 0:   # always so for serving (shard 1) and for a plan not shrunk
        return layout
    context = spec.context_parallel()
    shard = next((d for d in _divisors(replicas) if d >= layout.shard and d % context == 0), replicas)
    memory = _worst_stage(facts, spec, layout.tensor, layout.ranges, layout.stage_params, shard)
    return dataclasses.replace(layout, shard=shard, memory=memory)
