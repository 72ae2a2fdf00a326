"""The model's inference form: fused, transposed weight matrices, installed from outside.

`install_fused_weights(model)` runs once after loading and tensor-parallel slicing (so each rank
fuses its own slices). Per decoder layer it installs one q/k/v matrix and one gate/up matrix and
keeps every matrix transposed (InferenceLinear); the separate q, k, v, gate and up projections are
set to None, and the modules' one forward takes whichever projections they hold. Parameter names
change (attention.wqkv, feed_forward.w13): the fused form is for inference, not for training or
checkpoints. Where the weights then sit in memory (huge pages) is distributed/placement.py's
business, and another matrix kind (quantize.Int8Linear, gguf_blocks.BlockLinear) replaces an
InferenceLinear with the same `forward` and `mm`.
"""
from __future__ import annotations

import torch
from torch import nn

from shardwise.worker.model.moe import MoEFeedForward

# The matrices install_fused_weights concatenates (rows stacked in this order), by the name of the
# fused matrix in a decoder layer: what a per-matrix format (gguf_blocks.py) must build alike.
FUSED_MATRICES = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
                  "attention.wo": ("attention.wo",),
                  "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
                  "feed_forward.w2": ("feed_forward.w2",)}


def transposed_for_inference(weight: torch.Tensor) -> nn.Parameter:
    """`weight` [out, in] copied as the row-major [in, out] matrix inference multiplies by
    (x @ weight_t). On CPU a decode step (one row of x) streams it faster than nn.Linear's
    [out, in] (docs/worker.md, How it is built); on a GPU cuBLAS runs the same kernels in the same
    time for either layout, so one layout serves both."""
    return nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)


class InferenceMatrix(nn.Module):
    """A weight matrix of the inference form: `forward` for any leading dims, `mm` for 2-D x.

    Called without nn.Module's hook dispatch: nothing hooks these matrices (tensor parallelism's
    all-reduce hooks sit on the attention and feed-forward modules around them), and a decode step
    calls five a layer, where the dispatch costs about a microsecond each on top of ops that take a
    few. A hook registered on one would never run, so registering one is refused."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def register_forward_hook(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is called without hooks (see InferenceMatrix)")

    register_forward_pre_hook = register_forward_hook


class InferenceLinear(InferenceMatrix):
    """y = x @ weight_t (+ bias) (see transposed_for_inference)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_t = transposed_for_inference(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.mm(x)
        if self.bias is None:
            return x @ self.weight_t
        return self.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out], what another matrix kind with the same method
        (quantize.Int8Linear) provides alike."""
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


def fuse_attention(att: nn.Module) -> None:
    """One q/k/v matrix: one matmul per token instead of three (a decode step reads the weights
    once either way, but fewer, larger reads run faster). Biases (Qwen2) are concatenated in the
    same order, so the fused matmul adds them in one go."""
    parts = (att.wq, att.wk, att.wv)
    bias = torch.cat([p.bias for p in parts]) if att.wq.bias is not None else None
    att.wqkv = InferenceLinear(torch.cat([p.weight for p in parts]), bias)
    att.wo = InferenceLinear(att.wo.weight)
    att.wq = att.wk = att.wv = None


def fuse_feed_forward(ffn: nn.Module) -> None:
    """One gate/up matrix (see fuse_attention). A mixture of experts has nothing to concatenate
    for its routed experts (each runs on its own tokens); its shared expert fuses like a dense MLP."""
    if isinstance(ffn, MoEFeedForward):
        if ffn.shared_expert is not None:
            fuse_feed_forward(ffn.shared_expert)
        return
    ffn.w13 = InferenceLinear(torch.cat([ffn.w1.weight, ffn.w3.weight]))
    ffn.w2 = InferenceLinear(ffn.w2.weight)
    ffn.w1 = ffn.w3 = None


def fuse_head(model: nn.Module) -> None:
    """The LM head transposed; a tied embedding then reads its rows from the same table."""
    head, emb = model.output, model.tok_embeddings
    if head is None:
        return
    tied_here = emb is not None and getattr(emb, "weight", None) is head.weight
    if hasattr(head, "transpose_weight"):          # tensor_parallel.VocabParallelHead
        weight_t = head.transpose_weight()
        if tied_here:
            emb.use_transposed(weight_t)
    else:
        model.output = InferenceLinear(head.weight)
        if tied_here:
            model.tok_embeddings = InferenceEmbedding(model.output.weight_t)


def install_fused_weights(model: nn.Module) -> None:
    """Put a loaded (and tensor-parallel sliced) llama.Transformer in its inference form: fused
    q/k/v and gate/up matrices per layer, every matrix transposed (see the module docstring)."""
    for layer in model.layers.values():
        fuse_attention(layer.attention)
        fuse_feed_forward(layer.feed_forward)
    fuse_head(model)
    model.fused = True
