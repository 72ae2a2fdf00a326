"""A Llama-family decoder in plain torch, free of parallelism code.

Tensor parallelism (parallel.py) and pipeline stages (pipeline.py) are applied to this model from
the outside; it only knows which contiguous range of layers it holds and whether it holds the
token embedding (first stage) and the final norm + LM head (last stage).

Parameter names are the contract with loaders and checkpoints (gpt-fast naming):
    tok_embeddings.weight
    layers.<i>.attention_norm.weight
    layers.<i>.attention.{wq,wk,wv,wo}.weight
    layers.<i>.ffn_norm.weight
    layers.<i>.feed_forward.{w1,w3,w2}.weight       (w1 = gate, w3 = up, w2 = down)
    norm.weight
    output.weight                                   (absent from the state dict when tied)
`<i>` is the global layer index, so a stage's state dict names the same layers in every layout.

Two ways to run it:
  * full-sequence causal forward (training, parity checks): `model(tokens)` with no cache set up;
  * cached inference: `model.setup_caches(max_batch, max_seq)` then
    `model(tokens, positions=..., cache_slots=...)` where each row of the batch is one request
    living in cache row `cache_slots[b]` at positions `positions[b]`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


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
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one fused op (decode runs ~60 norms per token)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 like the reference implementation, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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
    """x: [B, heads, T, head_dim]; cos/sin: [B, 1, T, head_dim]. Half-split rotation (HF layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, seq: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               length: int):
        """Write k/v [B, kv, T, hd] at (slot, position) and return the first `length` positions.
        `slots` None means rows 0..B-1 of the cache in order (no gather needed)."""
        rows = torch.arange(k.shape[0], device=k.device) if slots is None else slots
        idx = (rows[:, None], slice(None), positions)
        self.k[idx] = k.transpose(1, 2)
        self.v[idx] = v.transpose(1, 2)
        if slots is None:
            b = k.shape[0]
            return self.k[:b, :, :length], self.v[:b, :, :length]
        return (self.k[:, :, :length].index_select(0, slots),
                self.v[:, :, :length].index_select(0, slots))


class InferenceLinear(nn.Module):
    """y = x @ weight_t, the weight stored transposed ([in, out], row-major).

    On CPU a decode step (one row of x) streams a [in, out] matrix 1.1-1.4x faster than
    nn.Linear's [out, in], and 3.6x faster for a 49k-row LM head (measured with
    benchmarks/worker_bench.py's model sizes), so inference keeps weights this way."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t


class InferenceEmbedding(nn.Module):
    """Embedding rows read from a transposed [hidden, vocab] table shared with a tied head."""

    def __init__(self, weight_t: nn.Parameter):
        super().__init__()
        self.weight_t = weight_t

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_t.t()[ids]


def cached_attention(q, k, v, mask):
    """q [B, H, T, D] against cached k/v [B, KV, L, D]; mask [B, T, L] (True = attend).

    Grouped-query attention without repeating k/v: the H/KV query heads that share a kv head are
    folded into the query length, so each kv head is read once. (On CPU this is several times
    faster than SDPA with a mask for decode, which is bound by reading the weights.)"""
    b, h, t, d = q.shape
    kv = k.shape[1]
    rep = h // kv
    q = q.reshape(b, kv, rep * t, d)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (d ** -0.5)
    scores = scores.view(b, kv, rep, t, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, rep * t, -1)
    return torch.matmul(probs, v).view(b, h, t, d)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_heads           # heads held here (parallel.py divides them)
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.wq = nn.Linear(h, config.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * self.head_dim, h, bias=False)
        self.kv_cache: KVCache | None = None
        self.wqkv: InferenceLinear | None = None     # set by fuse(): inference only

    def fuse(self) -> None:
        """Replace wq/wk/wv by one concatenated matrix: one matmul per token instead of three
        (decode reads the weights once either way, but fewer, larger reads run faster)."""
        self.wqkv = InferenceLinear(torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
        self.wo = InferenceLinear(self.wo.weight)
        del self.wq, self.wk, self.wv

    def forward(self, x, cos, sin, positions=None, cache_slots=None, length: int = 0, mask=None):
        b, t, _ = x.shape
        if self.wqkv is not None:
            # Fused: rotate the query and key heads in one go.
            qkv = self.wqkv(x).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
            qk = apply_rope(qkv[:, :self.n_heads + self.n_kv_heads], cos, sin)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            v = qkv[:, self.n_heads + self.n_kv_heads:]
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
            q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_heads != self.n_kv_heads
        if self.kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            kc, vc = self.kv_cache.update(cache_slots, positions, k, v, length)
            if mask is None:    # prefill from position 0: the new keys are all there is
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                y = cached_attention(q, kc, vc, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)  # down
        self.w13: InferenceLinear | None = None      # set by fuse(): inference only

    def fuse(self) -> None:
        """One matmul for gate and up (see Attention.fuse)."""
        self.w13 = InferenceLinear(torch.cat([self.w1.weight, self.w3.weight]))
        self.w2 = InferenceLinear(self.w2.weight)
        del self.w1, self.w3

    def forward(self, x):
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, positions=None, cache_slots=None, length: int = 0, mask=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, positions, cache_slots, length, mask)
        return x + self.feed_forward(self.ffn_norm(x))


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
        self.max_batch = self.max_seq = 0
        # Fixed attention length (the whole cache) and no host syncs, so a decode step can be
        # captured as a CUDA graph; on CPU attending only up to the longest row is faster.
        self.static_shapes = False

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them and this stage has both."""
        if self.config.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def fuse_for_inference(self) -> None:
        """Concatenate q/k/v and gate/up weights per layer (after loading and TP slicing, so each
        rank fuses its own slices). Parameter names change: not for training or checkpoints."""
        for layer in self.layers.values():
            layer.attention.fuse()
            layer.feed_forward.fuse()
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

    def setup_caches(self, max_batch: int, max_seq: int, dtype=None, device=None) -> None:
        ref = next(self.parameters())
        dtype, device = dtype or ref.dtype, device or ref.device
        for layer in self.layers.values():
            att = layer.attention
            att.kv_cache = KVCache(max_batch, att.n_kv_heads, max_seq, att.head_dim, dtype, device)
        self.max_batch, self.max_seq = max_batch, max_seq

    def clear_caches(self) -> None:
        for layer in self.layers.values():
            layer.attention.kv_cache = None
        self.max_batch = self.max_seq = 0

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim] for integer positions [B, T]; the table grows on demand."""
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
            self._rope = (emb.cos(), emb.sin())
        cos, sin = self._rope
        return cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache_slots: torch.Tensor | None = None, return_hidden: bool = False,
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
        cached = self.max_seq > 0
        if cached and cache_slots is not None and not self.static_shapes and cache_slots.numel() <= self.max_batch \
                and bool((cache_slots == torch.arange(cache_slots.numel(), device=cache_slots.device)).all()):
            cache_slots = None          # rows 0..B-1 in order: attend over cache rows without a gather
        if not cached:
            length = 0
        elif self.static_shapes:
            length = self.max_seq       # fixed shapes for CUDA graphs: attend over the whole cache, masked
        else:
            length = int(positions.max()) + 1
        # Row b attends to every cached position up to its own (rows' lengths differ); a prefill
        # that starts every row at position 0 needs only a causal mask (mask None).
        fresh = cached and not self.static_shapes and t > 1 and bool((positions[:, 0] == 0).all())
        mask = None
        if cached and not fresh:
            mask = torch.arange(length, device=h.device)[None, None, :] <= positions[:, :, None]
        cos, sin = self.rope(positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, positions if cached else None, cache_slots, length, mask)
        if self.norm is None:
            return h
        h = self.norm(h[:, -1:] if last_only else h)
        return h if return_hidden else self.output(h)
