"""Attention's pieces: rotary embeddings, the KV cache of one layer, the cache view a step reads
and writes through, and the attention kernels (causal, cached with a mask, decode without one).

A cached step does not know how requests map to cache slots: the caller hands it a `CacheStep`
(the serving side builds one from its block tables, serving/cache_view.py), so the model only
reads and writes the places it is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def rope_inv_freq(config) -> torch.Tensor:
    """Inverse RoPE frequencies of a llama.ModelConfig, with Llama-3 frequency scaling when the
    config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim] with cos/sin broadcasting to it. Half-split rotation (HF layout).

    `sin` is the signed table from Transformer.rope (first half negated), so the rotation
    (x1, x2) -> (-x2, x1) is a roll by half: four ops instead of seven, the same values."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        # Inductor reads a roll element by element (an index modulo head_dim) and recomputes it
        # inside the attention loop; two halves stay vector loads.
        return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * sin
    return x * cos + torch.roll(x, half, -1) * sin


@dataclass
class CacheStep:
    """The cache view of one cached step: what every layer shares, worked out once per step by
    the caller (serving/cache_view.py builds it from positions and block tables).

    index:  for each (batch row, kv head, token), its place in the cache viewed as [-1, head_dim]
            (one index_copy_ per layer writes the step's keys; an advanced-index put costs more)
    length: positions to attend over (the longest row's, or the whole context for static shapes)
    fresh:  a prefill that starts every row at position 0: causal attention over the new keys only
    mask:   [B, T, length], True = attend; None when every row attends to all `length` positions
    start, stride: where the rows' positions lie when they can be read in place: row b's position
            p at token slot start + b * stride + p (KVCache.read); None: they are gathered
    gather: otherwise, for each (row, kv head, position < length), its place in the cache
    groups: a ragged step (rows of different numbers of tokens, flattened into one row of all
            the step's tokens): the groups of rows that attend together (RowGroup); None otherwise
    spans:  a ragged step's fresh rows (several tokens from position 0: a prompt's first chunk),
            each the step's tokens [begin, end): causal attention over their own new keys, which
            reads no cache and takes SDPA's causal kernel (not part of any group)
    """
    index: torch.Tensor
    length: int
    fresh: bool
    mask: torch.Tensor | None
    start: int | None = 0
    stride: int = 0
    gather: torch.Tensor | None = None
    groups: list["RowGroup"] | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RowGroup:
    """Rows of a ragged step that attend together, as a dense batch of `rows` rows of `tokens`
    queries each: `query` [rows * tokens] picks them out of the step's N flattened tokens (a row
    with fewer tokens repeats its last one), `view` reads the rows' cached keys (length, mask,
    in place or gathered, as a CacheStep of those rows), and the results of the queries `keep`
    picks (None: all) go to the step's tokens `dest`."""
    rows: int
    tokens: int
    query: torch.Tensor
    view: CacheStep
    dest: torch.Tensor
    keep: torch.Tensor | None = None


class KVCache(nn.Module):
    """The keys and values of one layer: a pool of blocks of token positions, [kv heads, blocks *
    block_size, head_dim], shared by all requests (the serving side decides which block holds
    what). Each head's positions are one run of token slots, so a request whose blocks are
    consecutive is a plain slice, and rows whose slices are evenly spaced are one strided view:
    attention reads them in place, as it did from one fixed row per request."""

    def __init__(self, tokens: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (kv_heads, tokens, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, step: CacheStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v: [B, kv, T, hd], or [B, kv, hd] for one token per row."""
        d = k.shape[-1]
        self.k.view(-1, d).index_copy_(0, step.index, k.reshape(-1, d))
        self.v.view(-1, d).index_copy_(0, step.index, v.reshape(-1, d))

    def read(self, step: CacheStep, b: int):
        """k/v [B, kv, length, hd] of the step's rows: views of the pool, or gathered copies."""
        kv, tokens, d = self.k.shape
        if step.gather is not None:
            shape = (b, kv, step.length, d)
            return (self.k.view(-1, d).index_select(0, step.gather).view(shape),
                    self.v.view(-1, d).index_select(0, step.gather).view(shape))
        size, strides = (b, kv, step.length, d), (step.stride * d, tokens * d, d, 1)
        return (self.k.as_strided(size, strides, step.start * d),
                self.v.as_strided(size, strides, step.start * d))


def cached_attention(q, k, v, mask):
    """q [B, H, T, D] against cached k/v [B, KV, L, D]; mask [B, T, L] (True = attend).

    Grouped-query attention without repeating k/v: the H/KV query heads that share a kv head are
    folded into the query length, so each kv head is read once. (On CPU this beats SDPA with a
    mask for decode, which is bound by reading the weights.)"""
    b, h, t, d = q.shape
    kv = k.shape[1]
    rep = h // kv
    q = q.reshape(b, kv, rep * t, d)
    if q.is_cuda:
        # SDPA's masked kernel: one kernel, with the scores kept in fp32 (the matmul below
        # rounds them to the model's dtype first); faster for a long static-shape prefill.
        mask = mask[:, None, None].expand(b, 1, rep, t, mask.shape[-1]).reshape(b, 1, rep * t, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(b, h, t, d)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (d ** -0.5)
    scores = scores.view(b, kv, rep, t, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, rep * t, -1)
    return torch.matmul(probs, v).view(b, h, t, d)


def causal_attention(q, k, v):
    """q [B, H, T, D] over k/v [B, KV, T, D] of the same positions, causal."""
    rep = q.shape[1] // k.shape[1]
    if q.is_cuda and rep > 1:
        # Keys and values repeated per query head, as transformers does, so that SDPA picks
        # among the same kernels for the same inputs (enable_gqa narrows the choice).
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)


def decode_attention(q, k, v):
    """One new token per row (q [B, H, 1, D]) that attends to all L cached positions (k/v
    [B, KV, L, D]): no mask, so SDPA's fused kernel runs, with the query heads of each kv head
    folded into its query length as in cached_attention (faster than the masked path on CPU)."""
    b, h, _, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, h // kv, d)
    if torch.compiler.is_compiling() and q.device.type == "cpu":
        # Compiled on CPU, attention written as sums becomes two fused loops over the cache
        # instead of a call into SDPA's kernel.
        scores = (q[:, :, :, None] * k[:, :, None]).sum(-1, dtype=torch.float32) * (d ** -0.5)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return (probs[..., None] * v[:, :, None]).sum(-2).view(b, h, 1, d)
    return F.scaled_dot_product_attention(q, k, v).view(b, h, 1, d)


def ragged_attention(cache: KVCache, step: CacheStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, N, D]: the queries of a ragged step (CacheStep.groups), whose keys k/v
    [1, KV, N, D] are cached already. A fresh row attends causally to its own new keys (SDPA's
    causal kernel, no cache read); each group runs as a dense batch: one new token per row through
    decode_attention (SDPA's fused kernel when no mask is needed), several through
    cached_attention with the mask of each row's own positions. Returns [1, H, N, D]."""
    _, h, n, d = q.shape
    flat = q[0]
    out = flat.new_empty(h, n, d)
    for begin, end in step.spans:
        out[:, begin:end] = causal_attention(q[:, :, begin:end], k[:, :, begin:end], v[:, :, begin:end])[0]
    for g in step.groups:
        qg = flat.index_select(1, g.query).view(h, g.rows, g.tokens, d).transpose(0, 1)
        kc, vc = cache.read(g.view, g.rows)
        if g.view.mask is None and g.tokens == 1:
            y = decode_attention(qg, kc, vc)
        else:
            y = cached_attention(qg, kc, vc, g.view.mask)
        y = y.transpose(0, 1).reshape(h, g.rows * g.tokens, d)
        if g.keep is not None:
            y = y.index_select(1, g.keep)
        out.index_copy_(1, g.dest, y)
    return out[None]


def attend(cache: KVCache | None, step: CacheStep | None, q, k, v) -> torch.Tensor:
    """q [B, H, T, D] (or [B, H, D], one token per row) over this step's keys: the new ones
    alone (no cache, or a fresh prefill), else the cached ones after writing the new ones.
    Returns [B, H, T, D]."""
    if step is None or cache is None:
        return causal_attention(q, k, v)
    cache.write(step, k, v)
    if step.groups is not None:     # rows of different lengths, flattened: every key is written now
        return ragged_attention(cache, step, q, k, v)
    if step.fresh:      # prefill from position 0: the new keys are all there is
        return causal_attention(q, k, v)
    b = q.shape[0]
    if q.dim() == 3:
        q = q.view(b, q.shape[1], 1, q.shape[2])
    kc, vc = cache.read(step, b)
    return decode_attention(q, kc, vc) if step.mask is None else cached_attention(q, kc, vc, step.mask)
