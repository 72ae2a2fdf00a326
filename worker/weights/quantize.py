"""Weight-only INT8 for inference (`--quantize int8`), applied to the unchanged model from outside.

Like tensor parallelism (parallel.py) it is applied after loading, TP slicing and
inference.install_fused_weights, so each rank quantizes only its own slices: every decoder layer's
fused matrices (wqkv, wo, w13, w2) become an `Int8Linear` holding the int8 matrix and one float32
scale per output row (symmetric, absmax / 127). A row-parallel slice (wo, w2) keeps a scale per
output row of its own column slice: finer than slicing a whole-matrix quantization.

What stays in the compute dtype: the norms, the token embedding and the LM head. That is the rule
the planner sizes pods by (crds/modelshape.py ModelFacts.quantized), and a tied head is also the
embedding table (inference.InferenceEmbedding reads rows of it), which then needs no dequantized copy.
The head is one matrix; the decoder layers hold most of a model's weights. Biases (Qwen2's q/k/v)
stay too, added after the int8 matmul: a few values per output row, which the planner counts with
their matrices.

Activations keep the model's dtype (float32 on CPU, bfloat16 on CUDA); only the weights are int8.
How a matrix is multiplied (Int8Linear.mm):
  * CPU, one row (a decode step of one request): torch._weight_int8pack_mm, which reads the int8
    matrix directly, where its kernel runs for the dtype (checked once per dtype at run time);
  * otherwise (CUDA, a prefill, a batch of rows): the int8 matrix cast to the activation dtype,
    multiplied, then scaled per output column. Under torch.compile (--decode compile) inductor
    fuses the cast into the matmul's reads; run eagerly the cast is a separate pass over the
    matrix, so eager int8 decoding is slower than the unquantized model's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.worker.errors import WorkerError
from shardwise.worker.distributed.placement import place_in_huge_pages
from shardwise.worker.model.inference import InferenceLinear, InferenceMatrix

METHODS = ("none", "int8", "gguf")   # gguf: a GGUF file's own blocks, gguf_blocks.py
QMAX = 127          # symmetric: -127..127, so that -absmax and absmax are both exact


def check_method(method: str) -> None:
    if method not in METHODS:
        raise WorkerError(f"unknown quantization {method!r} (use one of: {', '.join(METHODS)})")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in] contiguous, float32 scales [out]): per output row,
    scale = absmax / 127 and q = round(w / scale), so |q * scale - w| <= scale / 2."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / QMAX
    # An all-zero row (the vocabulary padding of a split head, say) would divide by zero; any
    # scale gives it q = 0.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8).contiguous()
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The [out, in] matrix that `q` and `scales` stand for, in `dtype`."""
    return (q.float() * scales[:, None]).to(dtype)


@functools.lru_cache(maxsize=None)
def packed_kernel_runs(dtype: torch.dtype) -> bool:
    """Whether torch._weight_int8pack_mm (CPU) runs for activations of `dtype` in this torch build
    (it is a private op: its dtypes and presence vary between releases)."""
    try:
        out = torch._weight_int8pack_mm(torch.ones(1, 64, dtype=dtype), torch.ones(8, 64, dtype=torch.int8),
                                        torch.ones(8, dtype=dtype))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(out.shape == (1, 8) and torch.all(out.float() == 64))


class Int8Linear(InferenceMatrix):
    """y = x @ (weight * scales[:, None]).T with `weight` int8 [out, in] and float32 `scales`
    [out]; stands in for inference.InferenceLinear (forward for any leading dims, mm for 2-D x).

    Both are parameters (requires_grad=False), so parallel.weight_bytes counts their bytes,
    place_in_huge_pages moves the int8 matrix like any 2-D weight, and offload.py packs them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scales = quantize_int8(weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.packed = weight.device.type == "cpu" and packed_kernel_runs(weight.dtype)
        # kept as it was (not quantized): a few values a row, added after the scaling
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def replacing(cls, linear: InferenceLinear) -> "Int8Linear":
        return cls(linear.weight_t.t(), linear.bias)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype."""
        scales = self.scales.to(x.dtype)     # no copy in float32; [out] values otherwise
        if self.packed and x.shape[0] == 1 and not x.is_cuda:    # (quantized on CPU, then moved: offload)
            # More rows: the kernel's cost grows with each row (it is a matrix-vector loop; 64
            # rows took ~50x one row's time on the development machine), one cast does not.
            y = torch._weight_int8pack_mm(x, self.weight, scales)
        else:
            y = F.linear(x, self.weight.to(x.dtype)).mul_(scales)
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def quantize_weights(model: nn.Module, method: str, device: str = "cpu") -> int:
    """Quantize a fused model's decoder-layer matrices in place (see the module docstring), then
    place the CPU matrices in huge pages; returns how many matrices were quantized. Call it after
    inference.install_fused_weights, before placing anything: placing the float matrices first
    would keep their huge-page buffer alive (the head and embedding still point into it) next to the int8 copies.

    gguf: the matrices loader.load_stage(keep_blocks=True) kept as the file's blocks become
    gguf_blocks.BlockLinear, laid out for `device` (where they will run; a streamed model is
    built in host memory first); the others stay as loaded."""
    check_method(method)
    if method == "none":
        return 0
    if not getattr(model, "fused", False):
        raise WorkerError("quantize the model after install_fused_weights (inference only)")
    if method == "gguf":
        return _build_block_matrices(model, device)
    count = 0
    for layer in model.layers.values():
        for parent in (layer.attention, layer.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, InferenceLinear):
                    # One matrix at a time: its float copy is freed before the next is quantized.
                    setattr(parent, name, Int8Linear.replacing(child))
                    count += 1
    place_in_huge_pages(model)
    return count


def _build_block_matrices(model: nn.Module, device: str) -> int:
    from shardwise.worker.weights.gguf_blocks import BlockLinear
    blocks = getattr(model, "gguf_blocks", {})
    count = _build_vocab_blocks(model, blocks, device) + len(blocks)
    for key in list(blocks):        # popped one at a time: each file copy is freed once built
        _, i, fused = key.split(".", 2)
        layer = model.layers[i]
        placed = layer.attention_norm.weight.device          # where the stage's weights are now
        parent_name, _, name = fused.rpartition(".")
        parent = layer.get_submodule(parent_name)
        # the fused matrix it replaces (built on meta from the kept parameters) may carry real
        # biases, read like any other parameter: they stay beside the blocks
        bias = getattr(getattr(parent, name), "bias", None)
        setattr(parent, name, BlockLinear(blocks.pop(key), device, bias).to(placed))
    place_in_huge_pages(model)
    return count


def _build_vocab_blocks(model: nn.Module, blocks: dict, device: str) -> int:
    """The embedding and the LM head kept in blocks (loader._read_blocks: plain modules only),
    popped from `blocks`: the head a BlockLinear, the embedding a BlockEmbedding reading rows of its
    own BlockLinear or, tied, of the head's (one tensor for both). Returns how many matrices it built."""
    from shardwise.worker.weights.gguf_blocks import BlockEmbedding, BlockLinear
    emb, head = blocks.pop("tok_embeddings", None), blocks.pop("output", None)
    placed = next(p.device for p in model.parameters() if p.device.type != "meta")
    dtype = next(p.dtype for p in model.parameters() if p.device.type != "meta")
    table = None
    if head is not None:
        model.output = table = BlockLinear(head, device, rows=head is emb).to(placed)
    if emb is not None:
        table = table if head is emb else BlockLinear(emb, device, rows=True).to(placed)
        # registered last: a stage's first parameter stays one of the model's dtype (the
        # pipeline's buffers and the KV cache take their dtype from it), not a packed table
        del model.tok_embeddings
        model.tok_embeddings = BlockEmbedding(table, dtype)
    return len({id(b) for b in (emb, head) if b is not None})
