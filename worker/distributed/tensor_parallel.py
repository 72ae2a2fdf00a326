"""Inference's tensor parallelism, applied to the unchanged model (model/llama.py).

Per block, Megatron's layout as the model describes it (model/splits.py: q, k, v and gate/up
column-parallel, the heads split across ranks; o and down row-parallel). A column-parallel
matrix's bias (Qwen2's q, k, v) is split with its output rows. A mixture of experts splits its
experts over the group instead, and its shared expert like a dense MLP. The output of each
sub-layer (attention, feed_forward) is all-reduced by a forward hook on that module. A group set
up with `use_shm_allreduce` does its small CPU all-reduces through shared memory
(shm_allreduce.py), the others through torch.distributed. Plain tensors and explicit collectives,
not DTensor: the shared-memory all-reduce and the fused inference weights (model/inference.py)
work on plain tensors. Training splits the same table with DTensor plans (parallelize.py), which
autograd and FSDP understand.

The embedding and LM head are split along the vocabulary (padded to a multiple of the degree):
each rank looks up the ids it owns and the partial embeddings are summed; each rank computes its
slice of the logits and they are gathered. A tied head shares the embedding's slice. The slice may
be held in another form than floats (use_lookup, use_matrix: `--quantize gguf` keeps a GGUF file's
blocks of those rows, weights/quantize.py).

`apply_tensor_parallel` works on a model on the meta device (before loading) or on a loaded
one (it then slices the weights). It records in `model.tp_shards` how each parameter is split, so
loaders read only the rank's slice and checkpoints can be resharded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.worker.model.inference import transposed_for_inference
from shardwise.worker.model.moe import MoEFeedForward
from shardwise.worker.model.splits import ATTENTION_SPLITS, FEED_FORWARD_SPLITS, Split
from shardwise.worker.distributed.shm_allreduce import ShmAllReduce, connect


@dataclass
class CommStats:
    """Wall time and bytes this process spent in collectives and point-to-point transfers."""
    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def add(self, t0: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - t0
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1


COMM = CommStats()


@dataclass(frozen=True)
class Shard:
    """A parameter holds rows/cols [rank*size/world, (rank+1)*size/world) of `dim` of the full one.

    `padded` is the full size along `dim` after padding to a multiple of `world` (vocabulary
    splits); positions past the real size are zeros."""
    dim: int
    rank: int
    world: int
    padded: int = 0

    def bounds(self, full: int) -> tuple[int, int]:
        size = max(full, self.padded) // self.world
        return self.rank * size, (self.rank + 1) * size


# Per process group: its shared-memory all-reduce, for the groups that have one (use_shm_allreduce).
_SHM: dict[object, ShmAllReduce] = {}


def use_shm_allreduce(group, timeout: float) -> bool:
    """Collective over `group`: route its all-reduces through shared memory when every rank of
    it can (see shm_allreduce.connect); True when they now do. Only a gloo group of two or more
    ranks is a candidate: such a group is a TP group on one host; NCCL keeps its own."""
    if group is None or dist.get_world_size(group) < 2 or dist.get_backend(group) != "gloo":
        return False
    reducer = connect(group, timeout)
    if reducer is not None:
        _SHM[group] = reducer
    return reducer is not None


def close_shm_allreduces() -> None:
    """Unmap every group's shared memory; call before the process groups are destroyed."""
    for reducer in _SHM.values():
        reducer.close()
    _SHM.clear()


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    t0 = time.perf_counter()
    shm = _SHM.get(group)
    if shm is None or not shm.all_reduce(x):
        dist.all_reduce(x, group=group)
    COMM.add(t0, x)
    return x


def all_gather_last(x: torch.Tensor, group, world: int) -> torch.Tensor:
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    COMM.add(t0, x)
    return torch.cat(parts, dim=-1)


def _narrow_param(p: nn.Parameter, shard: Shard) -> nn.Parameter:
    """The rank's slice of p; on the meta device only the shape changes."""
    full = p.shape[shard.dim]
    padded = max(full, shard.padded)
    start, stop = shard.bounds(full)
    if p.is_meta:
        shape = list(p.shape)
        shape[shard.dim] = stop - start
        return nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    data = p.data
    if padded > full:
        pad = [0, 0] * (data.dim() - 1 - shard.dim) + [0, padded - full]
        data = F.pad(data, pad)
    return nn.Parameter(data.narrow(shard.dim, start, stop - start).clone(), requires_grad=p.requires_grad)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the (padded) vocabulary: [vocab_start, vocab_start + rows). Held as
    `weight`, as the tied head's transposed `weight_t` (use_transposed), or as a `lookup` module
    (use_lookup: a GGUF file's blocks, gguf_blocks.BlockEmbedding)."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.group = vocab_start, group
        self.rows = weight.shape[0]
        self.weight_t = None
        self.lookup = None

    def use_transposed(self, weight_t: nn.Parameter) -> None:
        """Read rows from the tied head's transposed table instead (inference.install_fused_weights)."""
        self.weight = None
        self.weight_t = weight_t

    def use_lookup(self, lookup: nn.Module) -> None:
        """Read rows through `lookup` (local ids [...] -> rows [..., hidden] of this rank's slice)
        instead of a table of floats."""
        self.weight = self.weight_t = None
        self.lookup = lookup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        local = local.masked_fill(outside, 0)
        if self.lookup is not None:
            out = self.lookup(local)
        else:
            out = F.embedding(local, self.weight) if self.weight_t is None else self.weight_t.t()[local]
        out = out.masked_fill(outside[..., None], 0)        # ids another rank owns add 0 to the sum
        return all_reduce(out, self.group)


class VocabParallelHead(nn.Module):
    """The rank's slice of the logits, gathered. The slice's matrix is `weight`, its transpose
    `weight_t` (transpose_weight) or a `matrix` module (use_matrix: a GGUF file's blocks,
    gguf_blocks.BlockLinear)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group, world: int, rank: int):
        super().__init__()
        self.weight = weight
        self.vocab_size, self.group, self.world, self.rank = vocab_size, group, world, rank
        self.weight_t = None
        self.matrix = None

    def transpose_weight(self) -> nn.Parameter:
        """Keep the slice as [hidden, vocab/world] for inference (inference.transposed_for_inference)."""
        self.weight_t = transposed_for_inference(self.weight)
        self.weight = None
        return self.weight_t

    def use_matrix(self, matrix: nn.Module) -> None:
        """Compute the slice's logits with `matrix` (h [..., hidden] -> [..., rows], an
        inference.InferenceMatrix) instead of a table of floats."""
        self.weight = self.weight_t = None
        self.matrix = matrix

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.matrix is not None:
            local = self.matrix(h)
        else:
            local = F.linear(h, self.weight) if self.weight_t is None else h @ self.weight_t
        logits = all_gather_last(local, self.group, self.world)
        return logits[..., :self.vocab_size]


def tp_degrees(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    """Tensor-parallel degrees that split both the query and the key/value heads evenly."""
    return [d for d in range(1, limit + 1) if num_heads % d == 0 and num_kv_heads % d == 0]


def check_tensor_parallel(config, tp: int) -> None:
    degrees = tp_degrees(config.num_heads, config.num_kv_heads)
    if tp < 1 or config.num_heads % tp or config.num_kv_heads % tp:
        raise ValueError(f"tensor parallel degree {tp} does not divide the model's {config.num_heads} "
                         f"attention heads and {config.num_kv_heads} key/value heads; use one of: "
                         f"{', '.join(map(str, degrees))}")
    facts = config.facts()      # the planner's rule for a degree that splits the model
    ok = ", ".join(str(d) for d in degrees if facts.tensor_fits(d))
    if config.num_experts and config.num_experts % tp:
        raise ValueError(f"expert parallel degree {tp} (the tensor parallel degree: experts split across "
                         f"its group) does not divide the model's {config.num_experts} experts; use one of: {ok}")
    if config.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor parallel degree {tp} does not divide the shared expert's intermediate size "
                         f"{config.shared_expert_intermediate_size}; use one of: {ok}")


def _split_linears(block: nn.Module, rank: int, world: int, shards: dict[str, Shard], prefix: str) -> None:
    """Split the block's dense matrices by model/splits.py's table, recording each split."""
    shard_of = {Split.COLUMN: Shard(0, rank, world), Split.ROW: Shard(1, rank, world)}
    tables = [("attention", ATTENTION_SPLITS)]
    ffn = block.feed_forward
    if not isinstance(ffn, MoEFeedForward):
        tables.append(("feed_forward", FEED_FORWARD_SPLITS))
    elif ffn.shared_expert is not None:
        # A dense MLP split like FeedForward: its partial output joins the routed experts'
        # partial sums in the same all-reduce. The gate stays replicated.
        tables.append(("feed_forward.shared_expert", FEED_FORWARD_SPLITS))
    for parent, table in tables:
        for child, split in table.items():
            name, shard = f"{parent}.{child}", shard_of[split]
            lin = block.get_submodule(name)
            lin.weight = _narrow_param(lin.weight, shard)
            lin.in_features, lin.out_features = lin.weight.shape[1], lin.weight.shape[0]
            shards[f"{prefix}{name}.weight"] = shard
            if lin.bias is not None:
                # Only column-parallel matrices have one here (q, k, v): it goes with their output
                # rows. A row-parallel bias would be added once per rank before the all-reduce.
                assert shard.dim == 0, name
                lin.bias = _narrow_param(lin.bias, shard)
                shards[f"{prefix}{name}.bias"] = shard


def _split_experts(ffn: MoEFeedForward, rank: int, world: int, shards: dict[str, Shard], prefix: str) -> None:
    """Expert parallel over the same group: whole experts per rank (moe.py says why)."""
    col = Shard(0, rank, world)
    for name in ("w1", "w3", "w2"):
        setattr(ffn, name, _narrow_param(getattr(ffn, name), col))
        shards[f"{prefix}feed_forward.{name}"] = col
    ffn.expert_start = col.bounds(ffn.num_experts)[0]


def _split_vocab(model: nn.Module, rank: int, world: int, group, shards: dict[str, Shard]) -> None:
    """The embedding and the LM head split along the (padded) vocabulary (splits.VOCAB_SPLITS)."""
    vocab = model.config.vocab_size
    vshard = Shard(0, rank, world, padded=-(-vocab // world) * world)
    emb_weight = None
    if model.tok_embeddings is not None:
        emb_weight = _narrow_param(model.tok_embeddings.weight, vshard)
        model.tok_embeddings = VocabParallelEmbedding(emb_weight, vshard.bounds(vocab)[0], group)
        shards["tok_embeddings.weight"] = vshard
    if model.output is not None:
        tied = model.config.tie_word_embeddings and emb_weight is not None
        head_weight = emb_weight if tied else _narrow_param(model.output.weight, vshard)
        model.output = VocabParallelHead(head_weight, vocab, group, world, rank)
        shards["output.weight"] = vshard


def apply_tensor_parallel(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Split `model` (llama.Transformer, whole or one stage) for TP rank `rank` of `world`; the
    attention's and the feed-forward's outputs (partial sums) are all-reduced by forward hooks."""
    check_tensor_parallel(model.config, world)
    shards: dict[str, Shard] = {}
    if world == 1:
        model.tp_shards, model.tp_rank, model.tp_world = shards, 0, 1
        return model
    for idx, block in model.layers.items():
        _split_linears(block, rank, world, shards, f"layers.{idx}.")
        if isinstance(block.feed_forward, MoEFeedForward):
            _split_experts(block.feed_forward, rank, world, shards, f"layers.{idx}.")
        block.attention.n_heads //= world
        block.attention.n_kv_heads //= world
        for sub in (block.attention, block.feed_forward):
            sub.register_forward_hook(lambda _m, _args, out: all_reduce(out.contiguous(), group))
    _split_vocab(model, rank, world, group, shards)
    model.tp_shards, model.tp_rank, model.tp_world = shards, rank, world
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a tied weight counts once), each at its own
    element size: an INT8 matrix (quantize.Int8Linear) at one byte an element plus its float32
    scales, which are parameters too."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
