"""A Llama-family decoder in plain torch, free of parallelism code.

Applied to it from outside: tensor parallelism (distributed/tensor_parallel.py: parameter splits
and all-reduce hooks, by the split table in splits.py), pipeline stages (serving/pipeline.py), the
weights' inference form (fused, transposed: inference.py), where they sit in memory
(distributed/placement.py), the paged cache's index (serving/cache_view.py builds the CacheStep a
cached step is given) and the compiled decode step (serving/fastpath.py). The model only knows
which contiguous range of layers it holds and whether it holds the token embedding (first stage)
and the final norm + LM head (last stage). Each module has one forward: what it runs depends on
what it is given (a cache view or none, 2-D rows or [B, T] sequences) and which projections it
holds (as loaded, or fused).

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
  * full-sequence causal forward (training, parity checks): `model(tokens)` with no cache;
  * cached inference: `model.setup_caches(blocks, max_seq, block_size)` then
    `model(tokens, positions=..., cache=step)` where each row of the batch is one request at
    positions `positions[b]`, and `step` (attention.CacheStep) says where in the cache the step's
    keys go and what each row attends to. A step of one token per row runs its rows as 2-D
    [B, hidden] tensors through the layers: 2-D matmuls and no transposes, the same math.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.crds.modelshape import ModelFacts, llama_params
from shardwise.worker.model.attention import CacheStep, KVCache, apply_rope, attend, rope_inv_freq
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
        """x [..., dim]. A 2-D x is the rows of a decode step (inference only: the form below
        works in place): in fp32 its mean square is one batched dot product (x.x / dim + eps)
        instead of F.rms_norm's CPU composite of several ops. Only the rounding differs (another
        sum order). Other fp32 inputs take F.rms_norm's one call (decode runs two norms a layer)."""
        if x.dim() == 2:
            if torch.compiler.is_compiling():
                # Written out, inductor fuses the whole norm into one kernel (the dot product
                # form would stay three calls).
                return self.written_out(x)
            if x.dtype == torch.float32:
                b, h = x.shape
                mean_sq = torch.baddbmm(x.new_full((1, 1, 1), self.eps), x.view(b, 1, h), x.view(b, h, 1),
                                        alpha=1 / h)
                return (x * mean_sq.view(b, 1).rsqrt_()).mul_(self.weight)
        elif x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.written_out(x)

    def written_out(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as plain ops, normalised in fp32 like the reference implementation, then cast back."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention. Its projections are wq, wk, wv and wo as loaded, or, in the
    inference form (inference.install_fused_weights), one wqkv with wq/wk/wv None. `kernel` is
    how q, k and v become attention (attention.attend); a parallel plan may set another on an
    instance (training/context_parallel.py: over keys gathered from the other sequence ranks)."""

    kernel = staticmethod(attend)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_heads           # heads held here (tensor_parallel.py divides them)
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        bias = config.attention_bias
        self.wq = nn.Linear(h, config.num_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(h, config.num_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.num_heads * self.head_dim, h, bias=False)
        self.wqkv: nn.Module | None = None
        self.kv_cache: KVCache | None = None
        # Qwen3: each query and key head RMS-normalised over head_dim before RoPE (replicated
        # under TP: the same small vector for every head).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def heads(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """[B, T, n * head_dim] -> [B, n, T, head_dim]; [B, n * head_dim] (one token per row)
        -> [B, n, head_dim], a view with no transpose."""
        if y.dim() == 2:
            return y.view(y.shape[0], n, self.head_dim)
        return y.view(y.shape[0], y.shape[1], n, self.head_dim).transpose(1, 2)

    def rotated_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v in heads (see heads), q and k normalised where the model says so and rotated.
        With one q/k/v matrix the query and key heads are adjacent: normalised and rotated in one go."""
        nq, nkv = self.n_heads, self.n_kv_heads
        if self.wqkv is not None:
            qkv = self.heads(self.wqkv(x), nq + 2 * nkv)
            qk = qkv[:, :nq + nkv]
            if self.q_norm is not None:
                q, k = qk.split([nq, nkv], dim=1)
                qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
            qk = apply_rope(qk, cos, sin)
            return qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
        q, k, v = self.heads(self.wq(x), nq), self.heads(self.wk(x), nkv), self.heads(self.wv(x), nkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, step: CacheStep | None = None):
        """x [B, T, hidden], or [B, hidden] for one token per row (cached: see Transformer)."""
        q, k, v = self.rotated_qkv(x, cos, sin)
        y = self.kernel(self.kv_cache, step, q, k, v)
        b = x.shape[0]
        if x.dim() == 2:
            return self.wo(y.reshape(b, -1))
        return self.wo(y.transpose(1, 2).reshape(b, x.shape[1], -1))


class FeedForward(nn.Module):
    """SwiGLU. Its projections are w1 (gate), w3 (up) and w2 (down) as loaded, or, in the inference
    form (inference.install_fused_weights), one w13 with w1/w3 None."""

    def __init__(self, config: ModelConfig, intermediate_size: int = 0):
        """intermediate_size: another width than the config's (a MoE layer's shared expert)."""
        super().__init__()
        i = intermediate_size or config.intermediate_size
        self.w1 = nn.Linear(config.hidden_size, i, bias=False)  # gate
        self.w3 = nn.Linear(config.hidden_size, i, bias=False)  # up
        self.w2 = nn.Linear(i, config.hidden_size, bias=False)  # down
        self.w13: nn.Module | None = None

    def forward(self, x):
        if self.w13 is not None:        # inference only: silu's output is ours to overwrite
            gate_up = self.w13(x)
            i = gate_up.shape[-1] // 2   # two slices: fewer ops than chunk's split into narrows
            return self.w2(F.silu(gate_up[..., :i]).mul_(gate_up[..., i:]))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """A pre-norm decoder layer. Under tensor parallelism the attention's and the MLP's outputs are
    partial sums; tensor_parallel.py all-reduces them with forward hooks on those two modules."""

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

    def forward(self, x, cos, sin, step: CacheStep | None = None):
        x = x + self.attention(self.attention_norm(x), cos, sin, step)
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
        self.max_seq = self.block_size = self.cache_tokens = 0      # see setup_caches
        self.fused = False                               # see inference.install_fused_weights
        # Called with a layer's name before it runs: offload.py streams its weights in.
        self.before_layer: Callable[[str], None] | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them and this stage has both."""
        if self.config.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer held here (tensor_parallel.py divides them)."""
        first = next(iter(self.layers.values()), None)
        return first.attention.n_kv_heads if first is not None else 1

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

    def clear_caches(self) -> None:
        for layer in self.layers.values():
            layer.attention.kv_cache = None
        self.max_seq = self.block_size = self.cache_tokens = 0

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim] for integer positions [B, T]; the table grows on demand.
        The sine's first half is negated (see attention.apply_rope)."""
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: CacheStep | None = None,
                return_hidden: bool = False, last_only: bool = False) -> torch.Tensor:
        """x: token ids [B, T] on the first stage, hidden states [B, T, H] on later ones.

        Returns logits [B, T, V] on the last stage (hidden states if `return_hidden`), hidden
        states [B, T, H] otherwise. Without `cache` this is a plain causal forward over x; with
        it, a cached step at `positions` [B, T] (see the module docstring). `last_only` keeps
        only the last position before the head (what generation needs).
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        b, t = h.shape[:2]
        if positions is None:
            positions = torch.arange(t, device=h.device).expand(b, t)
        cos, sin = self.rope(positions, h.dtype)
        return self.run_layers(h, cos, sin, cache, return_hidden, last_only)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: CacheStep | None,
                   return_hidden: bool = False, last_only: bool = False) -> torch.Tensor:
        """The layers, then (last stage) the final norm and the LM head; see forward. A cached
        step of one token per row runs as rows [B, hidden] (cos/sin [B, 1, head_dim]).
        serving/fastpath.compile_decode replaces it on an instance with a compiled decode step."""
        b, t = h.shape[:2]
        before = self.before_layer
        rows = step is not None and t == 1
        if rows:
            h, cos, sin = h.view(b, -1), cos.view(b, 1, -1), sin.view(b, 1, -1)
        for name, layer in self.layers.items():
            if before is not None:
                before(name)
            h = layer(h, cos, sin, step)
        if rows:
            h = h.view(b, 1, -1)
        if self.norm is None:
            return h
        h = self.norm(h[:, -1:] if last_only else h)
        return h if return_hidden else self.output(h)
