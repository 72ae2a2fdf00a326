"""Training parallelism applied from outside to the unchanged model (model/llama.py), on a DeviceMesh.

The mesh has five named dimensions, outermost first:

    dp_replicate × dp_shard × cp × pp × tp

Row-major over that order, a rank is (replica·P + stage)·T + tp with replica = (r·S + s)·C + c:
exactly crds/layout.py RankLayout's formula with D·C replicas, so a training pod's ranks (one pod
per replica and stage, its GPUs the TP ranks) need no second rule. Each dimension is PyTorch's own
machinery, but cp:

- cp: context parallelism (context_parallel.py): each sequence split over the cp ranks, keys and
  values all-gathered in each attention layer; parameters replicated over cp, so FSDP shards them
  over dp_shard × cp (the flattened "dp_shard_cp") as over more data-parallel ranks.

- tp: DTensor tensor parallel through a declarative plan (`BLOCK_TP_PLAN`) derived from the
  model's own table of Megatron's column/row split (model/splits.py, which inference's
  tensor_parallel.py splits by too); the embedding and the LM head split along the vocabulary.
  Attention then holds heads/T heads per rank (set here: the model reshapes by its own head counts).
- dp_shard: FSDP2 `fully_shard` per block and once at the root (ZeRO-3: parameters, gradients and
  optimizer state sharded; each block's parameters all-gathered just before use). With a mixed
  precision policy, the sharded parameters are the fp32 master weights, compute runs in the compute
  dtype (bf16 on GPU) and gradients are reduced in fp32.
- dp_replicate: HSDP (FSDP's 2-D mesh: reduce-scatter within a shard group, all-reduce across the
  replicas), or, when gradient compression is on, plain FSDP over dp_shard with the replicate-axis
  average done by compression.GradientCompressor after backward.
- pp: stages.py (torch.distributed.pipelining schedules).

Activation checkpointing recomputes each block's forward in backward (torch.utils.checkpoint),
wrapping the block's forward in place so parameter names stay those of the model and of every
checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils.checkpoint import checkpoint

from shardwise.crds.layout import RankLayout
from shardwise.worker.model.splits import BLOCK_SPLITS, VOCAB_SPLITS, Split

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "pp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the five mesh dimensions; data-parallel replicas = replicate × shard."""
    replicate: int = 1
    shard: int = 1
    pipeline: int = 1
    tensor: int = 1
    context: int = 1

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.context * self.pipeline * self.tensor

    @property
    def layout(self) -> RankLayout:
        return RankLayout(self.tensor, self.pipeline, self.data_parallel * self.context)

    def build(self, device_type: str) -> DeviceMesh:
        """The mesh of MESH_DIMS, unflattened from the one whose second dimension is the parameters'
        sharding dimension dp_shard × cp ("dp_shard_cp": see sharding_mesh)."""
        base = init_device_mesh(device_type, (self.replicate, self.shard * self.context, self.pipeline, self.tensor),
                                mesh_dim_names=("dp_replicate", "dp_shard_cp", "pp", "tp"))
        return base._unflatten("dp_shard_cp", (self.shard, self.context), ("dp_shard", "cp"))


def sharding_mesh(mesh: DeviceMesh, replicate: bool = True) -> DeviceMesh:
    """What FSDP shards the parameters over: dp_shard × cp, flattened (cp ranks hold the same
    parameters, as data-parallel ranks do), with dp_replicate before it when `replicate` (HSDP)."""
    base = mesh._get_root_mesh()    # MeshShape.build's: the flattened dimension is its own
    return base["dp_replicate", "dp_shard_cp"] if replicate else base["dp_shard_cp"]


# Per block, Megatron's layout as the model describes it (model/splits.py): the inputs of a
# sub-layer stay replicated, its first matmuls are split by output (heads, MLP columns), the last
# by input, and one all-reduce joins the halves.
BLOCK_TP_PLAN = {name: ColwiseParallel() if split is Split.COLUMN else RowwiseParallel()
                 for name, split in BLOCK_SPLITS.items()}


# Sequence parallelism (Korthikanti et al. 2022; torchtitan's plan): between the sub-layers the
# residual stream and the norms are split over the sequence (dim 1) instead of replicated, so each
# rank keeps 1/T of those activations and norms 1/T of the tokens. A sub-layer all-gathers its normed
# input (PrepareModuleInput) and its last matmul reduce-scatters its output to the sequence split
# instead of all-reducing it: the same bytes on the wire as Megatron's all-reduce.
BLOCK_SP_PLAN = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    **{name: ColwiseParallel() if split is Split.COLUMN else RowwiseParallel(output_layouts=Shard(1))
       for name, split in BLOCK_SPLITS.items()},
}


def _sequence_parallel_ends(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Where a stage's sequence split begins and ends: a stage receives and sends the full sequence
    (the rotary positions are computed from it, and a pipeline's stages exchange whole activations),
    its first block takes its rank's part of the sequence (a local slice: no communication), its
    last gathers it again, or on the last stage the final norm runs split and the head gathers."""
    blocks = list(model.layers.values())
    parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(), None, None, None), desired_input_layouts=(Shard(1), None, None, None),
        use_local_output=True))
    if model.norm is None:
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
        return
    parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split `model` (a stage of model.Transformer) over `tp_mesh` with DTensor plans; with
    `sequence_parallel`, the activations between sub-layers and the norms over the sequence too."""
    tp = tp_mesh.size()
    if tp == 1:
        return
    sp = sequence_parallel and len(model.layers) > 0
    tied = model.config.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None
    # The vocabulary split (splits.VOCAB_SPLITS) of each end: the embedding's vocabulary rows,
    # the partial lookups summed; the head's vocabulary columns of the logits, gathered.
    vocab_styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                    "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                              output_layouts=Replicate())}
    plan = {name: vocab_styles[name] for name, split in VOCAB_SPLITS.items()
            if split is Split.VOCAB and getattr(model, name) is not None}
    if tied:
        model.output.weight = nn.Parameter(model.output.weight.detach())   # untie: each split once
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, BLOCK_SP_PLAN if sp else BLOCK_TP_PLAN)
        block.attention.n_heads //= tp       # this rank's heads: the model reshapes by these
        block.attention.n_kv_heads //= tp
    if tied:   # the same vocabulary split on both sides: one parameter again
        model.output.weight = model.tok_embeddings.weight
    if sp:
        _sequence_parallel_ends(model, tp_mesh)


def apply_float8(model: nn.Module, fsdp_all_gather: bool) -> None:
    """fp8 training (torchao.float8, the "tensorwise" recipe: dynamic per-tensor scales, e4m3 for
    inputs and weights, e5m2 for gradients): each decoder block's linear layers become Float8Linear,
    whose matmuls run in float8 and whose weights stay what they were (the fp32 master weights, the
    same parameter names: checkpoints do not change). The embedding and the LM head are left as they
    are, as torchtitan does (the head's logits are the most precision-sensitive matmul).

    Applied from outside before tensor parallel and FSDP, torchtitan's order. `fsdp_all_gather`
    (with FSDP sharding over more than one rank): FSDP2 all-gathers each weight already cast to
    float8 (its scale from one all-reduce of the shards' amax) instead of in the compute dtype: the
    all-gather moves 1 byte a parameter instead of 2 (bf16), and the gathered buffer is half the size."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": fsdp_all_gather})
    for block in model.layers.values():
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=lambda mod, name: isinstance(mod, nn.Linear))


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    for block in model.layers.values():
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, compute_dtype: torch.dtype,
               reshard_after_forward: bool = True, prefetch: int = 0) -> None:
    """ZeRO-3 over `dp_mesh` (1-D: FSDP; 2-D replicate × shard: HSDP); fp32 master weights and
    gradient reduction, compute in `compute_dtype`. `prefetch` > 0: each block issues the
    all-gathers of the next `prefetch` blocks (forward) or previous ones (backward) before it
    computes, so they overlap its compute; 0 leaves FSDP2's own order (one block ahead in backward)."""
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if prefetch > 0:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])


# ------------------------------------------------------------------ full-tensor view of a shard

def local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, the full shape, the local tensor's offsets in it)."""
    if not isinstance(t, DTensor):
        return t, tuple(t.shape), (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    local = t.to_local().detach()   # the same storage; detached so that it can be loaded in place
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local, tuple(t.shape), tuple(offsets)


def copies(t: torch.Tensor, holders: int) -> int:
    """How many of the `holders` ranks that hold parameter `t` hold the same elements as this one."""
    if not isinstance(t, DTensor):
        return holders
    # FSDP over a tensor-parallel dimension is a _StridedShard, which is not is_shard(): count
    # every dimension that is not a replica.
    pieces = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if not p.is_replicate())
    return max(1, holders // pieces)


def clip_grad_norm_(params: list[tuple[nn.Parameter, int]], max_norm: float, device) -> float:
    """The gradient norm over the whole model, every element counted once, and clip it.

    `params` are (parameter, ranks holding it) pairs; each rank sums the squares of its local
    gradient divided by the number of ranks with identical elements, and one all-reduce over the
    world adds the rest (other stages, other shards)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p, holders in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += local.double().pow(2).sum() / copies(p.grad, holders)
    dist.all_reduce(sq)
    norm = math.sqrt(sq.item())
    if max_norm and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p, _ in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm

