"""Mixture-of-experts feed-forward (Mixtral, Qwen-MoE): a router picks `k` of `E` SwiGLU experts
for each token and the token's output is their weighted sum.

The experts' weights are stacked along a leading expert dimension (w1, w3 [E, I, H]; w2
[E, H, I]), so expert parallelism is a split of that dimension, recorded like tensor
parallelism's splits (tensor_parallel.apply_tensor_parallel): each rank of a tensor-parallel group holds
E / degree whole experts, and the loader reads only those experts' tensors.

Why no all-to-all: attention's output is all-reduced, so every rank of the group already holds
every token. Each rank routes all of them (the router is replicated and deterministic), runs the
tokens that chose its own experts, and the partial sums are all-reduced with the same hook as a
dense MLP's row-parallel output: one all-reduce of [tokens, hidden] per layer, the bytes a dense
TP layer moves, and no dispatch step. An all-to-all pays off when tokens are sharded across ranks
(sequence or data parallel inside the group), which inference here does not do.

Routing follows transformers' Mixtral and Qwen-MoE: softmax over all experts in float32, the top
k, renormalised to sum to one when the checkpoint says so (`norm_topk_prob`; Mixtral always does).

A shared expert (Qwen2-MoE) runs on every token beside the routed ones, scaled by
sigmoid(shared_expert_gate(x)), a [1, hidden] linear. Under expert parallel it is a dense MLP split
tensor-parallel (model/splits.py: column-parallel w1/w3, row-parallel w2) with a replicated gate, so
each rank adds its partial shared output to its routed partial sums before the one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoEFeedForward(nn.Module):
    def __init__(self, config, shared_expert: nn.Module | None = None):
        """shared_expert: a llama.FeedForward of the shared expert's width, or None (built by the
        caller: llama.py imports this module)."""
        super().__init__()
        h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.top_k = config.experts_per_token
        self.norm_topk_prob = config.norm_topk_prob
        self.num_experts = e                      # all of them: the router scores every expert
        self.expert_start = 0                     # the first expert this rank holds (set by tensor_parallel.py)
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, i, h))     # gate
        self.w3 = nn.Parameter(torch.empty(e, i, h))     # up
        self.w2 = nn.Parameter(torch.empty(e, h, i))     # down
        # Tokens routed to each expert of the layer since the model was loaded (load balance;
        # /metrics). Every rank of the group routes every token, so each counts all experts, not
        # only its own. A plain tensor, made on first use: the model is built on meta.
        self.tokens_per_expert: torch.Tensor | None = None
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k] global expert indices)."""
        probs = torch.softmax(F.linear(x, self.router.weight).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> this rank's experts' share of the output, x's shape (all-reduced by
        tensor_parallel.py's hook under expert parallelism)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        local = experts - self.expert_start
        held = self.w1.shape[0]
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        if self.tokens_per_expert is None:
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        self.tokens_per_expert += counts
        mine = counts[self.expert_start:self.expert_start + held]
        for e in mine.nonzero().flatten().tolist():             # only experts that got tokens
            token, slot = (local == e).nonzero(as_tuple=True)
            h = x[token]
            y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
            out.index_add_(0, token, y * weights[token, slot, None])
        if self.shared_expert is not None:
            # sigmoid(gate(x)) is one scalar per token, so scaling this rank's partial sum of the
            # shared expert before the all-reduce scales the all-reduced output exactly.
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out += gate * self.shared_expert(x)
        return out.view(shape)


def expert_load(model: nn.Module) -> dict[str, list[int]]:
    """Tokens routed to each expert so far, by layer name, for the MoE layers `model` holds."""
    out = {}
    for name, layer in getattr(model, "layers", {}).items():
        ffn = getattr(layer, "feed_forward", None)
        if isinstance(ffn, MoEFeedForward) and ffn.tokens_per_expert is not None:
            out[name] = ffn.tokens_per_expert.tolist()
    return out


def imbalance(counts: list[int]) -> float:
    """max / mean tokens per expert: 1 when every expert gets the same share, E when one gets all."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0
