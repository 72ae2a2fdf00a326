"""Context parallelism: each sequence split over the `cp` ranks of the mesh, applied from outside to
the unchanged model (as Llama 3's training did it: all-gathered keys and values).

Every sequence of length L is cut into 2·C chunks of L/(2C) tokens; cp rank i holds chunks i and
2C-1-i (the "zigzag" split), so that under the causal mask each rank's queries see the same number
of keys: chunk i sees i+1 chunks, chunk 2C-1-i sees 2C-i, 2C+1 in all on every rank. The data, the
rotary positions and the loss's targets are all this rank's tokens only; the parameters are
replicated over cp (FSDP shards them over dp_shard × cp like more data-parallel ranks), and the
gradients are averaged over cp as over data parallel: every rank holds the same number of tokens,
so the mean of the ranks' mean losses is the whole sequence's mean. The lengths that split so are
crds/training.py sequence_splits's (the API refuses the others too).

In each attention layer the plan swaps the model's attention kernel (Attention.kernel) for one that
all-gathers this layer's keys and values over cp (one collective of [2, B, kv heads, L/C, head_dim];
its backward sums the key/value gradients back to their owners), puts them in sequence order and
runs each local chunk's queries against the keys up to the chunk's end, under the causal mask of
its global positions. Per rank and layer that is (C-1)/C of the sequence's keys and values received
in forward and their gradients sent back in backward; the gathered keys and values are what the
activation memory does not divide by C.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def chunks_of(rank: int, degree: int) -> tuple[int, int]:
    """The two chunks (of 2·degree per sequence) that cp rank `rank` holds, in the order it holds them."""
    return rank, 2 * degree - 1 - rank


def local_part(x: torch.Tensor, rank: int, degree: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (its sequence along `dim`): its two chunks, concatenated."""
    if degree == 1:
        return x
    pieces = x.chunk(2 * degree, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, degree)], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward sums each rank's gradient of the whole back
    to the rank that owns each part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class ContextAttention:
    """The attention kernel of one cp rank (the signature of model/attention.attend): the local
    queries against the keys and values of the whole sequence, gathered over `group`."""

    def __init__(self, group: dist.ProcessGroup, rank: int, degree: int):
        self.group, self.rank, self.degree = group, rank, degree

    def __call__(self, cache, step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if cache is not None or step is not None:
            raise RuntimeError("context parallelism is for training's full-sequence forward, not a cached step")
        n, c = 2 * self.degree, q.shape[2] // 2        # chunks per sequence, tokens per chunk
        gathered = _GatherSequence.apply(torch.stack([k, v]), self.group)   # [C·2, B, kv, L/C, hd]
        order: list = [None] * n       # the sequence's chunks in order, from the ranks that hold them
        for r, kv in enumerate(gathered.chunk(self.degree)):
            first, second = chunks_of(r, self.degree)
            order[first], order[second] = kv[:, :, :, :c], kv[:, :, :, c:]
        keys, values = torch.cat(order, dim=3).unbind(0)   # [B, kv, L, hd] each
        rep = q.shape[1] // k.shape[1]
        out = []
        for j, chunk in enumerate(chunks_of(self.rank, self.degree)):
            end = (chunk + 1) * c                          # the keys this chunk can see: [0, end)
            query_pos = torch.arange(chunk * c, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]
            out.append(F.scaled_dot_product_attention(q[:, :, j * c:(j + 1) * c], keys[:, :, :end],
                                                      values[:, :, :end], attn_mask=mask, enable_gqa=rep > 1))
        return torch.cat(out, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Split `model` (a whole model.Transformer: one pipeline stage) over `cp_mesh`: its input is
    this rank's part of each sequence (local_part), its rotary positions those tokens' global ones,
    and every attention layer attends over the whole sequence (ContextAttention)."""
    degree = cp_mesh.size()
    if degree == 1:
        return
    rank, group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    kernel = ContextAttention(group, rank, degree)
    for block in model.layers.values():
        block.attention.kernel = kernel

    def global_positions(module, args, kwargs):
        if kwargs.get("positions") is None and kwargs.get("cache") is None:
            x = args[0]
            full = torch.arange(x.shape[1] * degree, device=x.device)
            kwargs["positions"] = local_part(full, rank, degree, dim=0).expand(x.shape[0], -1)
        return args, kwargs
    model.register_forward_pre_hook(global_positions, with_kwargs=True)
