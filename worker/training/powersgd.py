"""PowerSGD (Vogels et al. 2019): the mean of gradient matrices across a group as a rank-r product.

One job: given each rank's gradients (flattened into one fp32 buffer, as compression.py holds them)
and the warm-start bases Q of the previous step, return the low-rank mean, this rank's own share of
it (for error feedback) and the bytes this rank sent. compression.GradientCompressor calls it for
method "powersgd" and keeps the residuals and the bases.

The math is that of PyTorch's DDP hook (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook),
reused without DDP because the replicate axis here is averaged after FSDP2's backward, over local
gradient shards: each gradient is viewed as a matrix M (rows = its first dimension, cols = the
rest) of this rank's shard, and one step of power iteration, warm-started from the last step's Q,
approximates the mean of the ranks' M:
    P = M Q            all-reduced (summed): P = (sum_w M_w) Q; orthogonalized (P^T P = I)
    Q = M^T P          all-reduced and divided by the world: Q = mean_w(M_w)^T P
    mean = P Q^T       the projection of the mean gradient onto the r columns of P
Q is kept for the next step (warm start: the power iteration goes on across steps, so the basis
follows the slowly changing top singular vectors instead of starting from noise each step). A rank's
own share is P (M_w^T P)^T, the projection of its own M; what it leaves out, M_w - P P^T M_w, is its
error-feedback residual (the mean of these is exactly what the mean left out).

Sent uncompressed (summed in the same all-reduce as the P's): 1-D tensors (norms, biases) and
matrices too small for rank r to save at least half (torch's `_should_compress` rule:
(rows + cols) r * 2 < rows * cols). Bytes per rank: 4 (sum rows r + sum cols r + uncompressed
elements), both all-reduces together. Both payloads are sums, so unlike the gathered methods the
traffic per link does not grow with the number of replicas.

Q starts as a seeded Gaussian, orthogonalized (the seed is the gradient's position: the same Q on
every rank of the group without a broadcast). A Q that is not finite (a step whose gradients
overflowed) is started again the same way, so one bad step does not poison the later ones.
Every rank computes the same P and Q from the same all-reduced sums (orthogonalization is
deterministic on one kind of device), so replicas stay identical.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.crds import names
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

DEFAULT_RANK = names.POWERSGD_DEFAULT_RANK
MAX_RANK = names.POWERSGD_MAX_RANK
# added to each column's norm in Gram-Schmidt (rank <= 2): a gradient that is all zeros (a parameter
# that got none this step) leaves a zero column instead of a division by zero
EPSILON = 1e-8
_SEED = 0x5057   # offsets the per-position seeds of the initial bases


def matrix_of(shape: Sequence[int], rank: int) -> tuple[int, int, int] | None:
    """(rows, cols, r) of the matrix a gradient of `shape` is compressed as, or None when it is
    sent uncompressed (1-D, empty, or too small for rank `rank` to halve it)."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = 1
    for d in shape[1:]:
        cols *= int(d)
    r = min(rows, cols, rank)
    if r < 1 or not _should_compress(rows, cols, r, 2)[0]:
        return None
    return rows, cols, r


def orthogonalize_(m: torch.Tensor) -> torch.Tensor:
    """Make the columns of the (n, r) matrix `m` orthonormal, in place (QR above rank 2,
    Gram-Schmidt up to it, as the DDP hook does)."""
    _orthogonalize(m.unsqueeze(0), EPSILON)
    return m


def initial_basis(position: int, cols: int, r: int, device) -> torch.Tensor:
    """The starting Q of the gradient at `position`: the same on every rank."""
    g = torch.Generator().manual_seed(_SEED + position)
    return orthogonalize_(torch.randn(cols, r, generator=g, dtype=torch.float32).to(device))


def payload_bytes(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Bytes one rank sends for gradients of `shapes` (see the module doc)."""
    total = 0
    for shape in shapes:
        m = matrix_of(shape, rank)
        if m is None:
            n = 1
            for d in shape:
                n *= int(d)
            total += 4 * n
        else:
            rows, cols, r = m
            total += 4 * (rows + cols) * r
    return total


def low_rank_mean(grads: Sequence[torch.Tensor], flat: torch.Tensor, bases: dict[int, torch.Tensor],
                  rank: int, group) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the mean across `group`, this rank's own share of it, bytes sent) of `flat`, the fp32
    concatenation of `grads` (residuals already added). `bases` maps a gradient's position to its
    Q, read and replaced here (created where missing or of another shape)."""
    world = dist.get_world_size(group)
    mean, own = flat.clone(), flat.clone()   # uncompressed parts: sent in full, nothing left out
    dense, matrices, offset = [], [], 0
    for i, g in enumerate(grads):
        n = g.numel()
        m = matrix_of(g.shape, rank)
        if m is None:
            dense.append((offset, n))
        else:
            rows, cols, r = m
            q = bases.get(i)
            if q is None or q.shape != (cols, r) or not bool(torch.isfinite(q).all()):
                q = initial_basis(i, cols, r, flat.device)
            else:
                q = orthogonalize_(q.clone())
            matrices.append((i, flat[offset:offset + n].view(rows, cols), q))
        offset += n
    # 1. the uncompressed elements and every P = M Q, summed in one all-reduce
    first = torch.cat([flat[o:o + n] for o, n in dense] + [(mat @ q).reshape(-1) for _, mat, q in matrices]
                      or [flat.new_zeros(0)])
    dist.all_reduce(first, op=dist.ReduceOp.SUM, group=group)
    at = 0
    for o, n in dense:
        mean[o:o + n] = first[at:at + n] / world
        at += n
    ps = []
    for _, mat, q in matrices:
        rows, r = mat.shape[0], q.shape[1]
        ps.append(orthogonalize_(first[at:at + rows * r].view(rows, r).clone()))
        at += rows * r
    # 2. every Q = M^T P, averaged in a second all-reduce
    own_qs = [mat.T @ p for (_, mat, _), p in zip(matrices, ps)]
    second = torch.cat([q.reshape(-1) for q in own_qs] or [flat.new_zeros(0)])
    dist.all_reduce(second, op=dist.ReduceOp.SUM, group=group)
    second /= world
    at, offset_of = 0, _offsets(grads)
    for (i, mat, _), p, own_q in zip(matrices, ps, own_qs):
        cols, r = own_q.shape
        q = second[at:at + cols * r].view(cols, r).clone()
        at += cols * r
        o, n = offset_of[i], mat.numel()
        mean[o:o + n] = (p @ q.T).reshape(-1)
        own[o:o + n] = (p @ own_q.T).reshape(-1)
        kept = bases.get(i)
        if kept is not None and kept.shape == q.shape:
            kept.copy_(q)   # in place: a checkpoint's slices hold these tensors
        else:
            bases[i] = q
    sent = 4 * (first.numel() + second.numel())
    return mean, own, sent


def _offsets(grads: Sequence[torch.Tensor]) -> list[int]:
    out, offset = [], 0
    for g in grads:
        out.append(offset)
        offset += g.numel()
    return out
