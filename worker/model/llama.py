"""A Llama-family decoder in plain torch, free of parallelism code.

Tensor parallelism (parallel.py) and pipeline stages (pipeline.py) are applied to this model from
the outside; it only knows which contiguous range of layers it holds and whether it holds the
token embedding (first stage) and the final norm + LM head (last stage).

Parameter names are the contract with loaders and checkpoints (gpt-fast naming):
    tok_embeddings.weight
    layers.<i>.attention_norm.weight
    layers.<i>.attention.{wq,wk,wv,wo}.weight
    layers.<i>.attention.{wq,wk,wv}.bias            (Qwen2: attention_bias)
    layers.<i>.ffn_norm.weight
    layers.<i>.feed_forward.{w1,w3,w2}.weight       (w1 = gate, w3 = up, w2 = down)
    mixture of experts (moe.py), instead:
    layers.<i>.feed_forward.{router.weight,w1,w3,w2}          (w1/w3/w2 stacked [E, ...])
    layers.<i>.feed_forward.shared_expert.{w1,w3,w2}.weight   (Qwen2-MoE)
    layers.<i>.feed_forward.shared_expert_gate.weight
    norm.weight
    output.weight                                   (absent from the state dict when tied)
`<i>` is the global layer index, so a stage's state dict names the same layers in every layout.

Two ways to run it:
  * full-sequence causal forward (training, parity checks): `model(tokens)` with no cache set up;
  * cached inference: `model.setup_caches(blocks, max_seq, block_size)` then
    `model(tokens, positions=..., blocks=...)` where each row of the batch is one request whose
    positions `positions[b]` live in the cache blocks of its table `blocks[b]` (KVCache).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.crds.modelshape import ModelFacts, llama_params

from shardwise.worker.serving.kv_blocks import blocks_for
from shardwise.worker.model.moe import MoEFeedForward


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0                       # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    # Mixture of experts (moe.py); num_experts 0: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # A shared expert beside the routed ones, gated per token (Qwen2-MoE); 0: none.
    shared_expert_intermediate_size: int = 0
    qk_norm: bool = False                   # RMSNorm of each query and key head before RoPE (Qwen3)
    attention_bias: bool = False            # biases on q, k and v (Qwen2; o has none)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @property
    def num_params(self) -> int:
        return llama_params(self.num_layers, self.num_heads, self.num_kv_heads, self.hidden_size,
                            self.moe_intermediate_size if self.num_experts else self.intermediate_size,
                            self.vocab_size, self.tie_word_embeddings, self.head_dim, self.num_experts,
                            self.qk_norm, self.attention_bias, self.shared_expert_intermediate_size)

    def facts(self) -> ModelFacts:
        """This model's shape as the planner sees it, so that the worker splits layers with the
        planner's rule (crds/layout.py split_layers). bytes_per_param is left 0: the split counts
        parameters, and the bytes are those of whatever dtype the worker loads in."""
        return ModelFacts(layers=self.num_layers, heads=self.num_heads, kv_heads=self.num_kv_heads,
                          hidden=self.hidden_size, vocab=self.vocab_size, intermediate=self.intermediate_size,
                          params=self.num_params, bytes_per_param=0, tied_embeddings=self.tie_word_embeddings,
                          source="worker model config", experts=self.num_experts,
                          shared_intermediate=self.shared_expert_intermediate_size)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one op to call (decode runs ~60 norms per token)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.written_out(x)

    def written_out(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as plain ops, normalised in fp32 like the reference implementation, then cast back."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """forward for x [B, hidden] (TransformerBlock.decode). In fp32 the mean square is one
        batched dot product (x.x / hidden + eps) instead of F.rms_norm's CPU composite of ~10
        ops: 0.5 ms less per SmolLM2 decode step. Only the rounding differs (another sum order)."""
        if torch.compiler.is_compiling():
            # Written out, inductor fuses the whole norm into one kernel (the dot product form
            # below would stay three calls).
            return self.written_out(x)
        if x.dtype != torch.float32:
            return self.forward(x)
        b, h = x.shape
        mean_sq = torch.baddbmm(x.new_full((1, 1, 1), self.eps), x.view(b, 1, h), x.view(b, h, 1), alpha=1 / h)
        return (x * mean_sq.view(b, 1).rsqrt_()).mul_(self.weight)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3 frequency scaling when the config asks for it."""
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
    """x: [B, heads, T, head_dim]; cos/sin: [B, 1, T, head_dim]. Half-split rotation (HF layout).

    `sin` is the signed table from Transformer.rope (first half negated), so the rotation
    (x1, x2) -> (-x2, x1) is a roll by half: four ops instead of seven, the same values."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        # Inductor reads a roll element by element (an index modulo head_dim) and recomputes it
        # inside the attention loop; two halves stay vector loads. The compiled decode step's
        # attention kernel: 45 -> 27 us per SmolLM2 layer (two cores).
        return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * sin
    return x * cos + torch.roll(x, half, -1) * sin


@dataclass
class CacheStep:
    """What every layer of one cached step shares, worked out once per step (Transformer.forward).

    index:  for each (batch row, kv head, token), its place in the cache viewed as [-1, head_dim]
            (one index_copy_ per layer writes the step's keys; an advanced-index put costs 2-3x that)
    length: positions to attend over (the longest row's, or the whole context for static shapes)
    fresh:  a prefill that starts every row at position 0: causal attention over the new keys only
    mask:   [B, T, length], True = attend; None when every row attends to all `length` positions
    start, stride: where the rows' positions lie when they can be read in place: row b's position
            p at token slot start + b * stride + p (KVCache.read); None: they are gathered
    gather: otherwise, for each (row, kv head, position < length), its place in the cache
    """
    index: torch.Tensor
    length: int
    fresh: bool
    mask: torch.Tensor | None
    start: int | None = 0
    stride: int = 0
    gather: torch.Tensor | None = None


class KVCache(nn.Module):
    """The keys and values of one layer: a pool of blocks of token positions, [kv heads, blocks *
    block_size, head_dim], shared by all requests (kv_blocks.py decides which block holds what).
    Each head's positions are one run of token slots, so a request whose blocks are consecutive
    is a plain slice, and rows whose slices are evenly spaced are one strided view: attention
    reads them in place, as it did from one fixed row per request."""

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


def token_slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The token slots of `positions` [B, T] for rows with block tables `blocks` [B, nb]: device
    ops only (no host sync), for prefill chunks and CUDA graphs."""
    return torch.gather(blocks, 1, positions // block_size) * block_size + positions % block_size


def first_slots(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The token slots of every row's positions 0..length-1 [B, length] (token_slots)."""
    everything = torch.arange(length, device=blocks.device).expand(len(blocks), length)
    return token_slots(blocks, everything, block_size)


def cache_index(slots: torch.Tensor, kv_heads: int, tokens: int) -> torch.Tensor:
    """Places in a KVCache viewed as [-1, head_dim] of token `slots` [B, T], ordered (row, kv head,
    token) as k.reshape(-1, head_dim) of k [B, kv, T, hd]."""
    heads = torch.arange(kv_heads, device=slots.device) * tokens
    return (heads[None, :, None] + slots[:, None, :]).reshape(-1)


def in_place(tables: list[list[int]], ends: list[int], length: int, block_size: int, tokens: int):
    """(start, stride) when every row's first `ends[b]` positions lie on consecutive blocks and the
    rows' first blocks are evenly spaced, so the batch reads as one strided view (KVCache.read)
    of `length` positions per row; None otherwise. Positions past a row's own end read whatever
    follows it in the pool and are masked."""
    starts = []
    for table, end in zip(tables, ends):
        first, n = table[0], blocks_for(end, block_size)
        if table[n - 1] != first + n - 1 or table[:n] != list(range(first, first + n)):
            return None
        starts.append(first * block_size)
    stride = starts[1] - starts[0] if len(starts) > 1 else 0
    if len(starts) > 1 and (stride <= 0 or any(b - a != stride for a, b in zip(starts, starts[1:]))):
        return None
    if starts[-1] + length > tokens:
        return None
    return starts[0], stride


def transposed_for_inference(weight: torch.Tensor) -> nn.Parameter:
    """`weight` [out, in] copied as the row-major [in, out] matrix inference multiplies by
    (x @ weight_t). On CPU a decode step (one row of x) streams it faster than nn.Linear's
    [out, in]: up to 1.4x for the smaller layer matrices and ~1.05x for the larger ones and a
    49k-row LM head (benchmarks/worker_bench.py). On an H100 cuBLAS runs the same kernels in the
    same time for either layout (benchmarks/gpu_bench.py, profile), so one layout serves both."""
    return nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)


class InferenceLinear(nn.Module):
    """y = x @ weight_t (+ bias) (see transposed_for_inference)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_t = transposed_for_inference(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return self.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]: what the decode paths call, so that another matrix kind
        with the same method (quantize.Int8Linear) plugs in."""
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)     # the bias added in the matmul's epilogue


class InferenceEmbedding(nn.Module):
    """Embedding rows read from a transposed [hidden, vocab] table shared with a tied head."""

    def __init__(self, weight_t: nn.Parameter):
        super().__init__()
        self.weight_t = weight_t

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_t.t()[ids]


HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of zeroed CPU memory, 2 MiB-aligned, that the kernel is asked to back with
    transparent huge pages (madvise: the usual setting, under which torch's own allocations get
    4 KiB pages). None where mmap cannot ask for that."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(buf, dtype=torch.uint8)     # keeps `buf` alive as long as it lives
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip:skip + nbytes]


def place_in_huge_pages(model: nn.Module) -> int:
    """Move the model's CPU weight matrices into one huge-page buffer, in module order; returns its
    bytes (0 if nothing moved).

    A decode step streams every weight once from memory, one thread per rank; with 4 KiB pages
    that stream takes a TLB miss every 4 KiB. With 2 MiB pages the same matrix-vector products
    read 5-7% faster on the development machine (benchmarks/worker_bench.py, fp32). Tied
    parameters are one object, so they move once and stay tied."""
    params, seen = [], set()
    for p in model.parameters():
        if p.dim() == 2 and p.device.type == "cpu" and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    align = 64                          # a cache line: every matrix starts on one
    sizes = [-(-p.numel() * p.element_size() // align) * align for p in params]
    if not params:
        return 0
    buf = huge_page_buffer(sum(sizes))
    if buf is None:
        return 0
    offset = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        dst = buf[offset:offset + nbytes].view(p.dtype).view(p.shape)
        dst.copy_(p.data)
        p.data = dst
        offset += size
    return offset


def cached_attention(q, k, v, mask):
    """q [B, H, T, D] against cached k/v [B, KV, L, D]; mask [B, T, L] (True = attend).

    Grouped-query attention without repeating k/v: the H/KV query heads that share a kv head are
    folded into the query length, so each kv head is read once. (On CPU this is several times
    faster than SDPA with a mask for decode, which is bound by reading the weights.)"""
    b, h, t, d = q.shape
    kv = k.shape[1]
    rep = h // kv
    q = q.reshape(b, kv, rep * t, d)
    if q.is_cuda:
        # SDPA's masked kernel: one kernel, with the scores kept in fp32 (the matmul below
        # rounds them to the model's dtype first). A static-shape prefill of 1,000 tokens (a
        # 1B model, H100, benchmarks/gpu_bench.py) took 17-18 ms this way against 23.
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
    folded into its query length as in cached_attention (3x faster than the masked path on CPU)."""
    b, h, _, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, h // kv, d)
    if torch.compiler.is_compiling() and q.device.type == "cpu":
        # Compiled on CPU, attention written as sums becomes two fused loops over the cache
        # instead of a call into SDPA's kernel: ~0.7 ms less per SmolLM2 step (two cores).
        scores = (q[:, :, :, None] * k[:, :, None]).sum(-1, dtype=torch.float32) * (d ** -0.5)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return (probs[..., None] * v[:, :, None]).sum(-2).view(b, h, 1, d)
    return F.scaled_dot_product_attention(q, k, v).view(b, h, 1, d)


# The matrices fuse_for_inference concatenates (rows stacked in this order), by the name of the
# fused matrix in a decoder layer: what a per-matrix format (gguf_blocks.py) must build alike.
FUSED_MATRICES = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
                  "attention.wo": ("attention.wo",),
                  "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
                  "feed_forward.w2": ("feed_forward.w2",)}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_heads           # heads held here (parallel.py divides them)
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        bias = config.attention_bias
        self.wq = nn.Linear(h, config.num_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.num_heads * self.head_dim, h, bias=False)
        self.kv_cache: KVCache | None = None
        self.wqkv: InferenceLinear | None = None     # set by fuse(): inference only
        # Qwen3: each query and key head RMS-normalised over head_dim before RoPE (replicated
        # under TP: the same small vector for every head).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def normed(self, qk: torch.Tensor, dim: int) -> torch.Tensor:
        """The query heads then the key heads of `qk` (along `dim`), each normalised where the
        model has q/k norms; `qk` itself otherwise."""
        if self.q_norm is None:
            return qk
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=dim)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=dim)

    def fuse(self) -> None:
        """Replace wq/wk/wv by one concatenated matrix: one matmul per token instead of three
        (decode reads the weights once either way, but fewer, larger reads run faster). Biases
        (Qwen2) are concatenated in the same order, so the fused matmul adds them in one go."""
        parts = (self.wq, self.wk, self.wv)
        bias = torch.cat([p.bias for p in parts]) if self.wq.bias is not None else None
        self.wqkv = InferenceLinear(torch.cat([p.weight for p in parts]), bias)
        self.wo = InferenceLinear(self.wo.weight)
        del self.wq, self.wk, self.wv

    def forward(self, x, cos, sin, step: CacheStep | None = None):
        b, t, _ = x.shape
        if self.wqkv is not None:
            # Fused: rotate the query and key heads in one go.
            qkv = self.wqkv(x).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
            qk = apply_rope(self.normed(qkv[:, :self.n_heads + self.n_kv_heads], 1), cos, sin)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            v = qkv[:, self.n_heads + self.n_kv_heads:]
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step is None or self.kv_cache is None:
            y = causal_attention(q, k, v)
        else:
            self.kv_cache.write(step, k, v)
            if step.fresh:      # prefill from position 0: the new keys are all there is
                y = causal_attention(q, k, v)
            else:
                kc, vc = self.kv_cache.read(step, b)
                y = decode_attention(q, kc, vc) if step.mask is None else cached_attention(q, kc, vc, step.mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: CacheStep) -> torch.Tensor:
        """forward for one token per row on fused weights: x [B, hidden], cos/sin [B, 1, head_dim].
        Kept 2-D and in [B, heads, head_dim] so that no op is spent on transposes (see
        TransformerBlock.decode)."""
        b = x.shape[0]
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv.mm(x).view(b, nq + 2 * nkv, d)
        qk = apply_rope(self.normed(qkv[:, :nq + nkv], 1), cos, sin)
        self.kv_cache.write(step, qk[:, nq:], qkv[:, nq + nkv:])
        k, v = self.kv_cache.read(step, b)
        q = qk[:, :nq].view(b, nq, 1, d)
        y = decode_attention(q, k, v) if step.mask is None else cached_attention(q, k, v, step.mask)
        return self.wo.mm(y.reshape(b, nq * d))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int = 0):
        """intermediate_size: another width than the config's (a MoE layer's shared expert)."""
        super().__init__()
        i = intermediate_size or config.intermediate_size
        self.w1 = nn.Linear(config.hidden_size, i, bias=False)  # gate
        self.w3 = nn.Linear(config.hidden_size, i, bias=False)  # up
        self.w2 = nn.Linear(i, config.hidden_size, bias=False)  # down
        self.w13: InferenceLinear | None = None      # set by fuse(): inference only

    def fuse(self) -> None:
        """One matmul for gate and up (see Attention.fuse)."""
        self.w13 = InferenceLinear(torch.cat([self.w1.weight, self.w3.weight]))
        self.w2 = InferenceLinear(self.w2.weight)
        del self.w1, self.w3

    def forward(self, x):
        if self.w13 is not None:        # inference only: silu's output is ours to overwrite
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate).mul_(up))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """forward for x [B, hidden] on fused weights (see TransformerBlock.decode)."""
        gate_up = self.w13.mm(x)
        i = gate_up.shape[1] // 2
        return self.w2.mm(F.silu(gate_up[:, :i]).mul_(gate_up[:, i:]))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_experts:
            shared = config.shared_expert_intermediate_size
            self.feed_forward = MoEFeedForward(config, FeedForward(config, shared) if shared else None)
        else:
            self.feed_forward = FeedForward(config)
        # The tensor-parallel all-reduce of the attention and MLP outputs, set by parallel.py.
        # Module calls get it from forward hooks; decode below calls the
        # submodules' methods directly, so it applies it itself.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x, cos, sin, step: CacheStep | None = None):
        x = x + self.attention(self.attention_norm(x), cos, sin, step)
        return x + self.feed_forward(self.ffn_norm(x))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: CacheStep) -> torch.Tensor:
        """forward for one token per row (x [B, hidden]) on fused weights, in fewer ops: 2-D
        matmuls, no transposes, no module calls, one-dot-product norms.

        A decode step streams every weight through the CPU caches, so the small ops between the
        matmuls run with cold caches at 2-4x their warm time: on SmolLM2 they cost ~10 ms a step
        on top of ~35 ms of matmuls, and this path saves ~1.5 ms of it over forward. The
        tensor-parallel all-reduce comes from `reduce` here, since module hooks do not run."""
        a = self.attention.decode(self.attention_norm.decode(x), cos, sin, step)
        x = x + (a if self.reduce is None else self.reduce(a))
        f = self.feed_forward.decode(self.ffn_norm.decode(x))
        return x + (f if self.reduce is None else self.reduce(f))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (layers [layer_start, layer_end))."""

    def __init__(self, config: ModelConfig, layer_start: int = 0, layer_end: int | None = None,
                 embedding: bool = True, head: bool = True):
        super().__init__()
        self.config = config
        self.layer_start = layer_start
        self.layer_end = config.num_layers if layer_end is None else layer_end
        self.has_embedding, self.has_head = embedding, head
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size) if embedding else None
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(self.layer_start, self.layer_end)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if head else None
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        self.tie_weights()
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.max_seq = self.block_size = self.cache_tokens = 0      # see setup_caches
        # Fixed attention length (the whole cache) and no host syncs, so a decode step can be
        # captured as a CUDA graph; on CPU attending only up to the longest row is faster.
        self.static_shapes = False
        self.compiled_decode: Callable | None = None     # see compile_decode
        self.fused = False                               # see fuse_for_inference
        # Called with a layer's name before it runs: offload.py streams its weights in.
        self.before_layer: Callable[[str], None] | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them and this stage has both."""
        if self.config.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def fuse_for_inference(self, huge_pages: bool = True) -> None:
        """Concatenate q/k/v and gate/up weights per layer (after loading and TP slicing, so each
        rank fuses its own slices), keep the matrices transposed and, on CPU, in huge pages
        (`huge_pages` False: the caller changes the matrices further and places them itself,
        as quantize.quantize_weights does). Parameter names change: not for training or checkpoints."""
        for layer in self.layers.values():
            layer.attention.fuse()
            layer.feed_forward.fuse()
        self.fused = True
        self._fuse_head()
        if huge_pages:
            place_in_huge_pages(self)

    def _fuse_head(self) -> None:
        head, emb = self.output, self.tok_embeddings
        if head is None:
            return
        tied_here = emb is not None and getattr(emb, "weight", None) is head.weight
        if hasattr(head, "transpose_weight"):          # parallel.VocabParallelHead
            weight_t = head.transpose_weight()
            if tied_here:
                emb.use_transposed(weight_t)
        else:
            self.output = InferenceLinear(head.weight)
            if tied_here:
                self.tok_embeddings = InferenceEmbedding(self.output.weight_t)

    def setup_caches(self, blocks: int, max_seq: int, block_size: int = 0, dtype=None, device=None) -> None:
        """A KV cache of `blocks` blocks of `block_size` positions per layer (0: one whole context,
        max_seq, per block: a fixed row per request), for requests of up to `max_seq` positions."""
        ref = next(self.parameters())
        dtype, device = dtype or ref.dtype, device or ref.device
        self.block_size = block_size or max_seq
        self.cache_tokens = blocks * self.block_size
        for layer in self.layers.values():
            att = layer.attention
            att.kv_cache = KVCache(self.cache_tokens, att.n_kv_heads, att.head_dim, dtype, device)
        self.max_seq = max_seq
        if self.compiled_decode is not None:     # new caches: guards must be checked again
            self.compile_decode()

    def clear_caches(self) -> None:
        for layer in self.layers.values():
            layer.attention.kv_cache = None
        self.max_seq = self.block_size = self.cache_tokens = 0

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim] for integer positions [B, T]; the table grows on demand.
        The sine's first half is negated (see apply_rope)."""
        if self._rope is not None and self.max_seq and self._rope[0].shape[0] >= self.max_seq \
                and self._rope[0].device == positions.device:
            need = 0            # cached inference: the table covers the cache; no device sync
        else:
            need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != positions.device:
            size = max(need, min(self.config.max_position_embeddings, 4096), self.max_seq)
            inv_freq = rope_inv_freq(self.config).to(positions.device)
            freqs = torch.outer(torch.arange(size, device=positions.device, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            sign = torch.ones_like(emb)
            sign[:, :inv_freq.numel()] = -1     # apply_rope's roll needs -sin on the first half
            self._rope = (emb.cos(), emb.sin() * sign)
        cos, sin = self._rope
        return cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)

    def cache_step(self, positions: torch.Tensor, blocks: torch.Tensor, t: int) -> CacheStep:
        """Where a cached step writes its keys and values and what each row attends to; row b's
        positions `positions[b]` live in the blocks of its table `blocks[b]`."""
        first = next(iter(self.layers.values()), None)
        kv_heads = first.attention.n_kv_heads if first is not None else 1
        bs, tokens = self.block_size, self.cache_tokens
        if self.static_shapes:
            # Fixed shapes and no host syncs, for CUDA graphs: every row gathered over the whole
            # context, masked (each row is one block there: cuda_graphs.py).
            length = self.max_seq
            mask = torch.arange(length, device=positions.device)[None, None, :] <= positions[:, :, None]
            gather = cache_index(first_slots(blocks, length, bs), kv_heads, tokens)
            index = cache_index(token_slots(blocks, positions, bs), kv_heads, tokens)
            return CacheStep(index, length, False, mask, None, 0, gather)
        # The decisions below on host copies: one copy each instead of ~10 small ops and three
        # syncs (0.1 ms of a ~22 ms CPU decode step).
        rows, tables = positions.tolist(), blocks.tolist()
        length = max(max(row) for row in rows) + 1
        # A prefill that starts every row at position 0 needs only causal attention over its own
        # keys; a decode step whose rows all sit at the last position attends to everything
        # cached; otherwise row b attends to the cached positions up to its own.
        fresh = t > 1 and all(row[0] == 0 for row in rows)
        full = t == 1 and all(row[0] == length - 1 for row in rows)
        mask = None
        if not (fresh or full):
            mask = torch.arange(length, device=positions.device)[None, None, :] <= positions[:, :, None]
        if t > 1:
            index = cache_index(token_slots(blocks, positions, bs), kv_heads, tokens)
        else:       # one token per row, from host ints: one tensor instead of several small ops
            index = torch.tensor([head * tokens + table[p // bs] * bs + p % bs
                                  for table, (p,) in zip(tables, rows) for head in range(kv_heads)],
                                 device=positions.device)
        if fresh:
            return CacheStep(index, length, fresh, mask)
        view = in_place(tables, [row[-1] + 1 for row in rows], length, bs, tokens)
        if view is not None:
            return CacheStep(index, length, fresh, mask, *view)
        # Tables cover every row up to `length` (the engine pads them), so positions past a
        # row's own end gather some block's slots, masked.
        gather = cache_index(first_slots(blocks, length, bs), kv_heads, tokens)
        return CacheStep(index, length, fresh, mask, None, 0, gather)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                blocks: torch.Tensor | None = None, return_hidden: bool = False,
                last_only: bool = False) -> torch.Tensor:
        """x: token ids [B, T] on the first stage, hidden states [B, T, H] on later ones.

        Returns logits [B, T, V] on the last stage (hidden states if `return_hidden`), hidden
        states [B, T, H] otherwise. Without a cache this is a plain causal forward over x.
        `last_only` keeps only the last position before the head (what generation needs).
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        b, t = h.shape[:2]
        if positions is None:
            positions = torch.arange(t, device=h.device).expand(b, t)
        if blocks is not None and blocks.dim() == 1:
            blocks = blocks[:, None]        # one block per row: a fixed row of the whole context
        step = self.cache_step(positions, blocks, t) if self.max_seq > 0 else None
        cos, sin = self.rope(positions, h.dtype)
        run = self.compiled_decode if step is not None and t == 1 and self.compiled_decode else self.run_layers
        return run(h, cos, sin, step, return_hidden, last_only)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: CacheStep | None,
                   return_hidden: bool = False, last_only: bool = False) -> torch.Tensor:
        """The layers, then (last stage) the final norm and the LM head; see forward."""
        b, t = h.shape[:2]
        before = self.before_layer
        if step is not None and t == 1 and self.fused:
            h2, cos2, sin2 = h.view(b, -1), cos.view(b, 1, -1), sin.view(b, 1, -1)
            for name, layer in self.layers.items():
                if before is not None:
                    before(name)
                h2 = layer.decode(h2, cos2, sin2, step)
            h = h2.view(b, 1, -1)
        else:
            for name, layer in self.layers.items():
                if before is not None:
                    before(name)
                h = layer(h, cos, sin, step)
        if self.norm is None:
            return h
        h = self.norm(h[:, -1:] if last_only else h)
        return h if return_hidden else self.output(h)

    def compile_decode(self) -> None:
        """Run decode steps (one new token per row, cached) through torch.compile (inductor's C++
        code on CPU): norms, RoPE, cache writes, attention and SwiGLU become a few fused kernels
        between the weight matmuls. The step's bookkeeping (cache_step: host-side ints and
        checks) stays eager, so the compiled graph has no breaks. Lengths and batch sizes are
        symbolic; it compiles again for each kind of step (one row or several, with or without
        a mask or a gather of cache rows), 10-60 s each on two cores."""
        self.compiled_decode = CompiledDecode(self.run_layers)


class CompiledDecode:
    """torch.compile of Transformer.run_layers for decode steps, with the guard checks of a
    single-stream step skipped once that kind of step has run.

    Before each call torch.compile checks ~2,000 guards (every module attribute and weight it
    read), ~0.3 ms of a ~22 ms SmolLM2 step on two cores, paid by one row. Skipping them is safe
    only where nothing they check can change between calls, so it is limited to steps of one
    row at cache row 0 with no mask: there the only symbolic size is the attended length, whose
    single guard (2 <= length <= max_seq) every decode step meets, and the model's weights and
    caches are fixed, since setup_caches starts a new CompiledDecode. Several rows keep every
    guard: their sizes can coincide (batch size and length), which torch.compile guards on."""

    def __init__(self, run_layers: Callable):
        self.compiled = torch.compile(run_layers, dynamic=True)
        self.single_row_ran = False
        # One context manager, entered for each step: making one costs ~50 us, entering ~6 us.
        # Making it also sets the stance at once, so the previous one is put back here.
        self.skip_guards = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        self.skip_guards.__exit__(None, None, None)

    def __call__(self, h, cos, sin, step: CacheStep, return_hidden: bool, last_only: bool):
        single_row = h.shape[0] == 1 and step.mask is None and step.start == 0 and step.length >= 2
        if not (single_row and self.single_row_ran):
            out = self.compiled(h, cos, sin, step, return_hidden, last_only)
            self.single_row_ran = self.single_row_ran or single_row
            return out
        with self.skip_guards:
            return self.compiled(h, cos, sin, step, return_hidden, last_only)
