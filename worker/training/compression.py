"""Gradient compression with error feedback for the data-parallel (replicate) axis.

One job: average a list of gradient tensors across a process group, in place, sending fewer bytes
than a plain fp32 all-reduce. The trainer calls `GradientCompressor(method, group).all_reduce_mean_(
grads)` where it would call `plain_all_reduce_mean_(grads, group)`.

What each method sends (n = elements of all the gradients together, flattened in list order into
one fp32 buffer; every rank contributes one payload to a single all_gather, except none and
powersgd, whose payloads are sums, all-reduced):
    none   n fp32 values through an all-reduce (SUM, then / world):       4n bytes
    int8   per chunk of `chunk` elements, scale = absmax/127, q = round(x/scale) in [-127, 127];
           the n int8 values and ceil(n/chunk) fp32 scales:                  n + 4*ceil(n/chunk) bytes
           (an all-reduce of int8 would overflow and the scales differ per rank, so it is a gather:
           each rank dequantizes every rank's payload and sums)
    int4   the same with scale = absmax/7, q in [-7, 7], two values per byte (low nibble first,
           stored as q + 8):                                       ceil(n/2) + 4*ceil(n/chunk) bytes
    topk   k = max(1, ceil(density*n)) elements of largest |x|: k int32 indices (int64 when
           n >= 2**31) and k fp32 values:                                    8k bytes (12k with int64)
    topk-int4  the same indices, the k values quantized as int4 (chunks of `chunk` values in
           selection order):                                  4k + ceil(k/2) + 4*ceil(k/chunk) bytes
    powersgd   each matrix-shaped gradient (rows x cols) as a rank-`rank` product P Q^T, P and Q
           summed by two all-reduces (not a gather: the method is linear), 1-D and small ones
           uncompressed (powersgd.py):                 4 * sum((rows + cols) * r) + 4 * uncompressed
The mean is written back into each gradient, cast to its dtype (float32 or bfloat16).

Why error feedback: every compressor here is biased; top-k at 1% drops 99% of every gradient, and the
dropped coordinates, each small alone, are most of the descent direction: without memory, SGD stalls
far above the loss plain SGD reaches. With error feedback (Seide et al. 2014; Stich et al. 2018;
Karimireddy et al. 2019, "EF-SGD") each rank keeps what compression dropped from its own contribution,
    residual = (grad + residual) - decompress(compress(grad + residual)),
in fp32, one tensor per gradient keyed by its position in the list (updated in place, so the
tensors `residuals_for` handed to a checkpoint stay the live ones: compression_state.py), and adds it before compressing
the next time, so every coordinate is eventually sent in full, late; EF-SGD then converges at the rate
of SGD. `error_feedback=False` exists to show the difference (tests/worker/training/test_compression.py).
A residual entry that is not finite (a step whose gradients overflowed) is reset to zero, so one bad
step does not poison every later one; the non-finite value itself still reaches the mean (through the
int8 scale or as a top-k element), so the trainer's overflow check sees it.

Byte counts: `bytes_sent` is the payload this rank puts into the collective (its own contribution,
exactly the sizes above), `bytes_uncompressed` is 4n per call, what `plain_all_reduce_mean_` counts
for the same tensors; their ratio is the compression ratio. Traffic per link depends on the algorithm:
a ring all-reduce moves about 2(w-1)/w * 4n bytes through each rank, an all_gather (w-1) payloads, so
with w replicas int8 saves traffic while w < 8 and top-k while w < 1/density: meant for a small
replicate axis (2-8 replicas). powersgd is all-reduced, so it saves its ratio at any w.

powersgd's two all-reduces give every rank the same sums, from which it computes the same P and Q.
Every rank adds the gathered payloads in rank order and top-k indices of one rank are distinct, so the
mean has the same bits on every rank (no atomics ordering on CUDA): replicas stay identical. Pure
torch.distributed (gloo on CPU, NCCL on GPU); no Python loop over elements, only over ranks and tensors.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.crds import names
from shardwise.worker.training import powersgd

METHODS = names.COMPRESSION_METHODS
# the methods that send a fixed fraction of the elements (density applies to them)
SPARSE = ("topk", "topk-int4")


def _flat_fp32(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads])


def _write_back(grads: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view(g.shape))
            offset += n


def plain_all_reduce_mean_(grads: Sequence[torch.Tensor], group=None) -> int:
    """Average `grads` across `group` in place with one flat fp32 all-reduce; returns the bytes this
    rank contributed (4 per element), counted as GradientCompressor counts bytes_uncompressed."""
    if not grads:
        return 0
    flat = _flat_fp32(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= dist.get_world_size(group)
    _write_back(grads, flat)
    return flat.numel() * 4


def _bytes_as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A slice of an int8 payload read as `dtype` (copied when its offset is not aligned for it)."""
    if part.storage_offset() % torch.empty((), dtype=dtype).element_size():
        part = part.clone()
    return part.view(dtype)


def _gather(payload: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's equal-sized 1-D payload, in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
    dist.all_gather_into_tensor(out, payload, group=group)
    return list(out.view(world, -1))


# -- chunked integer quantization (int8 and int4 share it) ----------------------------------------

def _quantize(x: torch.Tensor, chunk: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q as int8 in [-qmax, qmax], one fp32 scale = absmax/qmax per chunk, the dequantized x)."""
    n = x.numel()
    chunks = -(-n // chunk)
    padded = torch.zeros(chunks * chunk, dtype=x.dtype, device=x.device)
    padded[:n] = x
    rows = padded.view(chunks, chunk)
    scale = rows.abs().amax(dim=1) / qmax  # NaN/inf stay in the scale: the mean shows them
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    own = (q.to(x.dtype) * scale[:, None]).view(-1)[:n]
    return q.view(-1)[:n], scale, own


def _dequantize(q: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    n = q.numel()
    padded = torch.zeros(scale.numel() * chunk, dtype=torch.float32, device=q.device)
    padded[:n] = q
    return (padded.view(-1, chunk) * scale[:, None]).view(-1)[:n]


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7] two per byte (low nibble first), as int8 bytes."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    return (u[0::2] | (u[1::2] << 4)).view(torch.int8)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    u = packed.view(torch.uint8)
    both = torch.stack([u & 15, u >> 4], dim=1).view(-1)[:n]
    return both.to(torch.int16).sub_(8).to(torch.int8)


def _quant_bytes(n: int, chunk: int, bits: int) -> int:
    """Bytes of n values quantized to `bits` with one fp32 scale per chunk."""
    return (n if bits == 8 else -(-n // 2)) + 4 * -(-n // chunk)


def _encode_q(x: torch.Tensor, chunk: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload bytes: the quantized values then the scales, the dequantized x)."""
    q, scale, own = _quantize(x, chunk, 127 if bits == 8 else 7)
    body = q if bits == 8 else _pack4(q)
    return torch.cat([body, scale.view(torch.int8)]), own


def _decode_q(part: torch.Tensor, n: int, chunk: int, bits: int) -> torch.Tensor:
    size = n if bits == 8 else -(-n // 2)
    q = part[:size] if bits == 8 else _unpack4(part[:size], n)
    return _dequantize(q, _bytes_as(part[size:], torch.float32), chunk)


class GradientCompressor:
    """Compressed mean of gradients across `group` (None: the default world) with error feedback.

    method: one of METHODS ("none": plain fp32 all-reduce, so the trainer can hold one object);
    density: fraction of elements top-k sends, in (0, 1]; chunk: elements per int8 scale;
    rank: PowerSGD's approximation rank."""

    def __init__(self, method: str, group=None, density: float = 0.01, chunk: int = 4096,
                 error_feedback: bool = True, rank: int = powersgd.DEFAULT_RANK):
        if method not in METHODS:
            raise ValueError(f"unknown compression method {method!r}: choose one of {', '.join(METHODS)}")
        if (isinstance(density, bool) or not isinstance(density, numbers.Real)
                or not 0.0 < density <= 1.0):  # NaN fails the comparison too
            raise ValueError(f"compression density must be in (0, 1], got {density!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
            raise ValueError(f"compression chunk must be a positive integer, got {chunk!r}")
        if (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)
                or not 1 <= rank <= powersgd.MAX_RANK):
            raise ValueError(f"compression rank must be an integer from 1 to {powersgd.MAX_RANK}, got {rank!r}")
        self.method = method
        self.rank = int(rank)
        self.group = group
        self.density = float(density)
        self.chunk = int(chunk)
        self.error_feedback = error_feedback
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self._residuals: dict[int, torch.Tensor] = {}
        # powersgd: the warm-start Q of each gradient position (same on every rank of the group)
        self._bases: dict[int, torch.Tensor] = {}

    # -- error feedback -------------------------------------------------------------------------

    def _add_residuals(self, grads: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        if not self.error_feedback:
            return
        offset = 0
        for i, g in enumerate(grads):
            n = g.numel()
            r = self._residuals.get(i)
            if r is not None and r.shape == g.shape:  # a different tensor at i: its residual is gone
                flat[offset:offset + n] += r.reshape(-1).to(flat.device)
            offset += n

    def _keep_residuals(self, grads: Sequence[torch.Tensor], residual: torch.Tensor) -> None:
        if not self.error_feedback:
            return
        residual = torch.where(torch.isfinite(residual), residual, torch.zeros_like(residual))
        offset = 0
        for i, g in enumerate(grads):
            n = g.numel()
            part = residual[offset:offset + n].view(g.shape)
            kept = self._residuals.get(i)
            if kept is not None and kept.shape == g.shape:
                kept.copy_(part)  # in place: a checkpoint's slices hold these tensors
            else:
                self._residuals[i] = part.clone()
            offset += n
        for i in [i for i in self._residuals if i >= len(grads)]:
            del self._residuals[i]

    # -- the collective -------------------------------------------------------------------------

    def all_reduce_mean_(self, grads: list[torch.Tensor]) -> None:
        """Replace each gradient by its mean across the group (compressed; see the module doc)."""
        if not grads:
            return
        if self.method == "none":
            sent = plain_all_reduce_mean_(grads, self.group)
            self.bytes_sent += sent
            self.bytes_uncompressed += sent
            return
        flat = _flat_fp32(grads)
        self._add_residuals(grads, flat)
        if self.method == "powersgd":
            mean, own, sent = powersgd.low_rank_mean(grads, flat, self._bases, self.rank, self.group)
        elif self.method in SPARSE:
            mean, own, sent = self._topk(flat, 4 if self.method == "topk-int4" else 32)
        else:
            mean, own, sent = self._quantized(flat, 4 if self.method == "int4" else 8)
        self._keep_residuals(grads, flat.sub_(own))
        self.bytes_sent += sent
        self.bytes_uncompressed += flat.numel() * 4
        _write_back(grads, mean)

    def _quantized(self, flat: torch.Tensor, bits: int):
        n = flat.numel()
        payload, own = _encode_q(flat, self.chunk, bits)
        mean = torch.zeros_like(flat)
        for part in _gather(payload, self.group):  # rank order: the same bits on every rank
            mean += _decode_q(part, n, self.chunk, bits)
        return mean / dist.get_world_size(self.group), own, payload.numel()

    def _topk(self, flat: torch.Tensor, bits: int):
        """Top-k by magnitude; its values sent as fp32 (bits 32) or quantized to int4 per chunk."""
        n = flat.numel()
        k = min(n, max(1, math.ceil(self.density * n)))
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        _, idx = flat.abs().topk(k, sorted=False)  # NaN counts as the largest: it is sent
        values = flat[idx]
        if bits == 32:
            body, sent_values = values.view(torch.int8), values
        else:
            body, sent_values = _encode_q(values, self.chunk, bits)
        own = torch.zeros_like(flat)
        own[idx] = sent_values
        payload = torch.cat([idx.to(index_dtype).view(torch.int8), body])
        split = k * torch.empty((), dtype=index_dtype).element_size()
        mean = torch.zeros_like(flat)
        parts = _gather(payload, self.group)
        for part in parts:  # one rank's indices are distinct: each element gets one add per rank
            idx_r = _bytes_as(part[:split], index_dtype).long()
            values_r = (_bytes_as(part[split:], torch.float32) if bits == 32
                        else _decode_q(part[split:], k, self.chunk, bits))
            mean.index_add_(0, idx_r, values_r)
        mean /= len(parts)
        return mean, own, payload.numel()

    # -- checkpoint -----------------------------------------------------------------------------

    def residuals_for(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The residual of each gradient position, created as fp32 zeros (shape of `tensors[i]`)
        where there is none yet: the tensors a checkpoint saves and loads in place."""
        out = []
        for i, t in enumerate(tensors):
            r = self._residuals.get(i)
            if r is None or r.shape != t.shape:
                r = self._residuals[i] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
            out.append(r)
        return out

    def bases_for(self, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """powersgd: the warm-start Q of each gradient position that is compressed as a matrix,
        created as the first step would where there is none yet; {} for the other methods."""
        if self.method != "powersgd":
            return {}
        out = {}
        for i, t in enumerate(tensors):
            m = powersgd.matrix_of(t.shape, self.rank)
            if m is None:
                continue
            _, cols, r = m
            q = self._bases.get(i)
            if q is None or q.shape != (cols, r):
                q = self._bases[i] = powersgd.initial_basis(i, cols, r, t.device)
            out[i] = q
        return out

    def reset_bases(self) -> None:
        """Start every warm-start Q again from its seeded initial value (the next step makes them)."""
        self._bases.clear()

    def state_dict(self) -> dict:
        """The residuals and powersgd's bases (fp32, by position in the gradient list)."""
        return {"method": self.method, "residuals": {i: r.clone() for i, r in self._residuals.items()},
                "bases": {i: q.clone() for i, q in self._bases.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._residuals = {int(i): r.detach().to(torch.float32).clone()
                           for i, r in state.get("residuals", {}).items()}
        self._bases = {int(i): q.detach().to(torch.float32).clone() for i, q in state.get("bases", {}).items()}
