"""Weight-only INT8 for inference (`--quantize int8`), applied to the unchanged model from outside.

Like tensor parallelism (parallel.py) it is applied after loading, TP slicing and
inference.install_fused_weights, so each rank quantizes only its own slices: every decoder layer's
fused matrices (wqkv, wo, w13, w2) become an `Int8Linear`: int8 values with one scale per group of
INT8_GROUP (crds/modelshape.py) inputs of each row (symmetric, absmax / 127 over the group).

Why groups of 32: one scale per output row let a row's few large weights set the step for all of
its small ones; measured on SmolLM2 over a 334-token text against the float32 model (teacher
forced, docs/worker.md), the mean KL divergence of the next-token distribution was 0.0028 with a
scale per row, 0.0017 with groups of 64 or 128 and 0.0012 with groups of 32, and perplexity
+0.86%, +0.68% and +0.29%. Groups of 32 cost 0.125 bytes a weight more than 64 in the CPU form.

What stays in the compute dtype: the norms, the token embedding and the LM head. That is the rule
the planner sizes pods by (crds/modelshape.py ModelFacts.quantized), and a tied head is also the
embedding table (inference.InferenceEmbedding reads rows of it), which then needs no dequantized copy.
Biases (Qwen2's q/k/v) stay too, added after the int8 matmul.

How a matrix is held and multiplied (Int8Linear):
  * CPU (where torch's int4 kernel runs): the int8 values split into two exact 4-bit planes, like
    a GGUF Q8_0 matrix (gguf_blocks.int8_planes), multiplied by `aten._weight_int4pack_mm_for_cpu`
    with bfloat16 activations and group scales: reading 1.25 bytes a weight instead of casting the
    matrix. torch._weight_int8pack_mm, the CPU op with int8 weights, takes one scale per row only,
    and ran 1.3x slower than the planes in bfloat16 and 6x slower in float32 on the development
    machine (a head-sized matrix, one row).
  * CUDA, up to int8_cuda.ROWS_FUSED rows (decode): int8_cuda's Triton kernel reads the int8 matrix
    and applies the group scales itself (unproven on a GPU; see int8_cuda.py).
  * otherwise (a prefill on CUDA, no kernel): the matrix dequantized to the activation dtype, then
    one matmul (under --decode compile inductor fuses the dequantization into the matmul's reads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.crds.modelshape import INT8_GROUP
from shardwise.worker.errors import WorkerError
from shardwise.worker.distributed.placement import place_in_huge_pages
from shardwise.worker.model.inference import InferenceLinear, InferenceMatrix
from shardwise.worker.weights.int8_cuda import ROWS_FUSED, cuda_kernel_runs, int8_matmul_cuda

METHODS = ("none", "int8", "gguf")   # gguf: a GGUF file's own blocks, gguf_blocks.py
QMAX = 127          # symmetric: -127..127, so that -absmax and absmax are both exact
KERNEL_GROUPS = (32, 64, 128, 256)     # the group sizes torch's CPU int4 kernel takes


def check_method(method: str) -> None:
    if method not in METHODS:
        raise WorkerError(f"unknown quantization {method!r} (use one of: {', '.join(METHODS)})")


def int8_group(inputs: int, group: int = INT8_GROUP) -> int:
    """The group size used for a matrix of `inputs` columns: `group` where it divides them (a
    row-parallel slice may not), else the largest smaller power of two from 32 that does, else the
    whole row (one scale per output row)."""
    for g in (group, 64, 32):
        if g <= group and inputs % g == 0:
            return g
    return inputs


def quantize_int8(weight: torch.Tensor, group: int = INT8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in] contiguous, float32 scales [out, in / g]) with g =
    int8_group(in, group): per group of g inputs of each row, scale = absmax / 127 and
    q = round(w / scale), so |q * scale - w| <= scale / 2."""
    w = weight.detach().float()
    out, inputs = w.shape
    g = int8_group(inputs, group)
    scales = w.view(out, inputs // g, g).abs().amax(dim=2) / QMAX
    # An all-zero group (the vocabulary padding of a split head, say) would divide by zero; any
    # scale gives it q = 0.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w.view(out, -1, g) / scales[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(out, inputs).contiguous(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The [out, in] matrix that `q` and `scales` (one per group of inputs) stand for, in `dtype`."""
    out, inputs = q.shape
    return (q.float().view(out, scales.shape[1], -1) * scales.float()[..., None]).view(out, inputs).to(dtype)


class Int8Linear(InferenceMatrix):
    """y = x @ w.T with w = q * scale per group of inputs (quantize_int8); stands in for
    inference.InferenceLinear (forward for any leading dims, mm for 2-D x).

    Held as one of two forms, by where it runs (see the module docstring):
      * `blocks`: on a CPU where torch's int4 kernel runs, a gguf_blocks.BlockLinear of the int8
        values' two 4-bit planes (exact values; the group scales in bfloat16);
      * `weight` int8 [out, in] and `scales` bfloat16 [out, groups] otherwise.
    All are parameters (requires_grad=False), so parallel.weight_bytes counts their bytes and
    offload.py packs them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = INT8_GROUP):
        super().__init__()
        from shardwise.worker.weights.gguf_blocks import BlockLinear, KERNEL_ROWS, cpu_kernel_runs, int8_planes
        q, scales = quantize_int8(weight, group)
        self.group = q.shape[1] // scales.shape[1]
        self.out_features, self.in_features = q.shape
        # kept as it was (not quantized): a few values a row, added after the matmul
        bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.blocks = self.weight = self.scales = self.bias = None
        self.fused = False
        if (weight.device.type == "cpu" and self.out_features % KERNEL_ROWS == 0 and self.group in KERNEL_GROUPS
                and cpu_kernel_runs()):
            self.blocks = BlockLinear(int8_planes(q.numpy(), scales.numpy(), self.group), "cpu", bias)
            return
        self.weight = nn.Parameter(q, requires_grad=False)
        # bfloat16, as on the CPU form: 2 bytes per 32 weights (crds/modelshape.py INT8_BYTES)
        self.scales = nn.Parameter(scales.to(torch.bfloat16), requires_grad=False)
        self.bias = bias
        self.fused = weight.is_cuda and cuda_kernel_runs()

    @classmethod
    def replacing(cls, linear: InferenceLinear) -> "Int8Linear":
        return cls(linear.weight_t.t(), linear.bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] matrix these int8 values stand for (tests; the fallback path)."""
        if self.blocks is not None:
            return self.blocks.dequantized(dtype)
        return dequantize_int8(self.weight, self.scales, dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype."""
        if self.blocks is not None:
            return self.blocks.mm(x)
        if self.fused and x.is_cuda and x.shape[0] <= ROWS_FUSED:
            y = int8_matmul_cuda(x, self.weight, self.scales)
        else:
            y = F.linear(x, self.dequantized(x.dtype))
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def quantize_weights(model: nn.Module, method: str, device: str = "cpu", activations=None) -> int:
    """Quantize a fused model's decoder-layer matrices in place (see the module docstring), then
    place the CPU matrices in huge pages; returns how many matrices were quantized. Call it after
    inference.install_fused_weights, before placing anything: placing the float matrices first
    would keep their huge-page buffer alive (the head and embedding still point into it) next to the int8 copies.

    gguf: the matrices loader.load_stage(keep_blocks=True) kept as the file's blocks become
    gguf_blocks.BlockLinear, laid out for `device` (where they will run; a streamed model is
    built in host memory first); the others stay as loaded. activations: the block-dot kernel's
    (crds/modelshape.py BlockActivations) for those blocks on a CPU; None: torch's int4 kernel."""
    check_method(method)
    if method == "none":
        return 0
    if not getattr(model, "fused", False):
        raise WorkerError("quantize the model after install_fused_weights (inference only)")
    if method == "gguf":
        return _build_block_matrices(model, device, activations)
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


def _build_block_matrices(model: nn.Module, device: str, activations) -> int:
    from shardwise.worker.weights.gguf_blocks import BlockLinear
    blocks = getattr(model, "gguf_blocks", {})
    count = _build_vocab_blocks(model, blocks, device, activations) + len(blocks)
    for key in list(blocks):        # popped one at a time: each file copy is freed once built
        _, i, fused = key.split(".", 2)
        layer = model.layers[i]
        placed = layer.attention_norm.weight.device          # where the stage's weights are now
        parent_name, _, name = fused.rpartition(".")
        parent = layer.get_submodule(parent_name)
        # the fused matrix it replaces (built on meta from the kept parameters) may carry real
        # biases, read like any other parameter: they stay beside the blocks
        bias = getattr(getattr(parent, name), "bias", None)
        setattr(parent, name, BlockLinear(blocks.pop(key), device, bias, activations=activations).to(placed))
    place_in_huge_pages(model)
    return count


def _build_vocab_blocks(model: nn.Module, blocks: dict, device: str, activations) -> int:
    """The embedding and the LM head kept in blocks (loader._read_blocks), popped from `blocks`:
    the head a BlockLinear, the embedding a BlockEmbedding reading rows of its own BlockLinear or,
    tied, of the head's (one tensor for both). Under tensor parallelism they are the rank's
    vocabulary slices, held by the vocab-parallel modules (tensor_parallel.VocabParallelHead's
    use_matrix, VocabParallelEmbedding's use_lookup), which mask and gather as before. Returns how
    many matrices it built."""
    from shardwise.worker.weights.gguf_blocks import BlockEmbedding, BlockLinear
    emb, head = blocks.pop("tok_embeddings", None), blocks.pop("output", None)
    placed = next(p.device for p in model.parameters() if p.device.type != "meta")
    dtype = next(p.dtype for p in model.parameters() if p.device.type != "meta")
    table = None
    if head is not None:
        table = BlockLinear(head, device, rows=head is emb, activations=activations).to(placed)
        if hasattr(model.output, "use_matrix"):
            model.output.use_matrix(table)
        else:
            model.output = table
    if emb is not None:
        table = table if head is emb else BlockLinear(emb, device, rows=True, activations=activations).to(placed)
        lookup = BlockEmbedding(table, dtype)
        module = model.tok_embeddings
        if hasattr(module, "use_lookup"):
            module.use_lookup(lookup)
        else:
            module = lookup
        # registered last: a stage's first parameter stays one of the model's dtype (the
        # pipeline's buffers and the KV cache take their dtype from it), not a packed table
        del model.tok_embeddings
        model.tok_embeddings = module
    return len({id(b) for b in (emb, head) if b is not None})
