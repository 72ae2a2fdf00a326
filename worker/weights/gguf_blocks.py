"""A GGUF file's Q8_0, Q4_0 and Q4_1 blocks kept as they are stored (`--quantize gguf`).

Without this the loader dequantizes every GGUF tensor (SmolLM2's 90 MB Q4_1 file becomes 540 MB
of float32). With it, each decoder-layer matrix of a rank keeps its slice of the file's blocks,
re-laid-out for torch's int4 weight-only matmul (`aten._weight_int4pack_mm_for_cpu`), whose
weight is w = (v - 8) * scale + zero for 4-bit v and a scale and zero per block of 32 inputs:

  Q4_0  w = (v - 8) * d                  scale d, zero 0
  Q4_1  w = v * d + m                    scale d, zero m + 8d
  Q8_0  w = d * q, q = 16 * hi + lo      two 4-bit planes over the same inputs: hi + 8 with
        (hi = q >> 4 in -8..7,           scale 16d, zero 0, and lo with scale d, zero 8d; the
         lo = q & 15 in 0..15)           matmul runs over [hi plane | lo plane] with x twice

On a CPU where the block-dot kernel builds (block_dot.py: `--block-activations`, default fine),
a GGUF file's matrices run on it instead: the 4-bit values repacked in tiles of 8 rows, the
file's float16 scales as they are (Q8_0 as the same two planes), the activations quantized per
block of 32 inside the product. What follows describes torch's int4 kernel, the path elsewhere.

Every value is exact; the scales and zeros are held in bfloat16 (the kernel's fast dtype: its
float32 and float16 variants run 30-45x slower on the development machine), so they round from
the file's float16 like a bfloat16 model's weights do. Activations go through the kernel in
bfloat16 and come back in the model's dtype. In memory that is 0.5 bytes a weight plus 4 bytes a
block for Q4 (0.625) and twice that for Q8_0 (1.25): crds/modelshape.py GGUF_NATIVE_BYTES, the
planner's rule, which the tests hold this layout to.

Where the kernel does not run (a CUDA device, a torch build without it) the same values stay
packed two a byte and each matmul dequantizes its matrix first, in the activation dtype (under
`--decode compile` inductor fuses that into the matmul's reads).

The embedding and the LM head are kept so too (loader._read_blocks), whole or, under tensor
parallelism, the rank's vocabulary slice of rows (Blocks.rows: a row's blocks are whole, so the
slice is exact): the head is a BlockLinear, the embedding a BlockEmbedding that dequantizes only
the rows it looks up, read from the kernel's own packing (kernel_row_layout); a tied pair shares
one BlockLinear per rank.

Other GGUF types (Q6_K, Q5_K, ...) have no fast path: the loader dequantizes those tensors, and
runtime.validate says so in one line.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from shardwise.crds.modelshape import GGUF_NATIVE_BYTES, BlockActivations
from shardwise.worker.model.inference import InferenceMatrix
from shardwise.worker.weights import block_dot

NATIVE = tuple(GGUF_NATIVE_BYTES)   # the types kept as stored: Q8_0, Q4_0, Q4_1
# (values, bytes) per block of each, from the gguf package's table of ggml types
_SIZES = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]] for name in NATIVE}
BLOCK = 32                          # values per block, for all three types
assert all(values == BLOCK for values, _ in _SIZES.values())
_BLOCK_BYTES = {name: nbytes for name, (_, nbytes) in _SIZES.items()}


@dataclass
class Blocks:
    """One matrix (or a rank's slice of it) as the file stores it: `data` uint8 [rows, blocks *
    block bytes], a whole number of blocks per row."""
    qtype: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // _BLOCK_BYTES[self.qtype] * BLOCK

    def columns(self, start: int, stop: int) -> "Blocks | None":
        """Inputs [start, stop) of every row (a row-parallel slice); None where the bounds are not
        on block boundaries (then the loader dequantizes instead)."""
        if start % BLOCK or stop % BLOCK:
            return None
        size = _BLOCK_BYTES[self.qtype]
        return Blocks(self.qtype, self.data[:, start // BLOCK * size:stop // BLOCK * size])

    def rows(self, start: int, stop: int) -> "Blocks":
        """Rows [start, stop) (a column-parallel or vocabulary slice: a row's blocks are whole, so
        the slice is exact); rows past the matrix's end are zero blocks, whose scale (and Q4_1
        min) 0 makes every value 0, as the padding of a vocabulary split is."""
        have = self.data[min(start, len(self.data)):min(stop, len(self.data))]
        if len(have) == stop - start:
            return Blocks(self.qtype, have)
        pad = np.zeros((stop - start - len(have), self.data.shape[1]), dtype=np.uint8)
        return Blocks(self.qtype, np.concatenate([have, pad]))

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        """Rows of several matrices stacked (fused q/k/v, gate/up); all of one type."""
        return Blocks(parts[0].qtype, np.concatenate([p.data for p in parts]))


def int4_planes(blocks: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks -> (v uint8 [rows, inputs'] in 0..15, scale float32 [rows, inputs' / 32], zero
    likewise) with w = (v - 8) * scale + zero per block (see the module docstring); inputs' is
    twice the inputs for Q8_0."""
    rows = blocks.data.shape[0]
    raw = blocks.data.reshape(rows, -1, _BLOCK_BYTES[blocks.qtype])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if blocks.qtype == "Q8_0":
        q = raw[..., 2:34].copy().view(np.int8)
        hi = (q >> 4).astype(np.uint8) + 8          # arithmetic shift: -8..7, then 0..15
        lo = q.view(np.uint8) & 15
        values = np.concatenate([hi.reshape(rows, -1), lo.reshape(rows, -1)], axis=1)
        scale = np.concatenate([16 * d, d], axis=1)
        zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
        return values, scale, zero
    qs = raw[..., -16:]                             # element i in the low nibble, i + 16 in the high
    values = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)
    if blocks.qtype == "Q4_0":
        return values, d, np.zeros_like(d)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return values, d, m + 8 * d


@dataclass
class Planes:
    """4-bit values uint8 [rows, inputs'] in 0..15 with a scale and a zero (float32 [rows, inputs' /
    group]) per group of inputs: w = (v - 8) * scale + zero. twice: two planes of 8-bit values
    over the same inputs (inputs' = 2 * inputs), as int4_planes makes of Q8_0 and int8_planes of
    quantize.py's INT8."""
    qtype: str
    values: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    group: int = BLOCK

    @property
    def twice(self) -> bool:
        return self.qtype in ("Q8_0", "int8")


def int8_planes(q: np.ndarray, scale: np.ndarray, group: int) -> Planes:
    """int8 q [rows, inputs] with a scale per group of inputs (w = q * scale) as two planes, the
    way int4_planes splits Q8_0: hi = q >> 4 (+ 8, scale 16d) and lo = q & 15 (scale d, zero 8d)."""
    hi = (q >> 4).astype(np.uint8) + 8
    lo = q.view(np.uint8) & 15
    d = scale.astype(np.float32)
    return Planes("int8", np.concatenate([hi, lo], axis=1), np.concatenate([16 * d, d], axis=1),
                  np.concatenate([np.zeros_like(d), 8 * d], axis=1), group)


@functools.lru_cache(maxsize=None)
def cpu_kernel_runs() -> bool:
    """Whether aten._weight_int4pack_mm_for_cpu runs here and computes (v - 8) * scale + zero
    (a private op: its presence and layout vary between torch releases)."""
    rows = KERNEL_ROWS
    v = torch.arange(rows * BLOCK, dtype=torch.int32).remainder(16).view(rows, BLOCK)
    scale = torch.arange(1, rows + 1, dtype=torch.float32) / 4
    zero = torch.arange(rows, dtype=torch.float32) - 3
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(v, 1)
        sz = torch.stack([scale, zero], dim=-1)[None].to(torch.bfloat16)     # [blocks, rows, 2]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, BLOCK, dtype=torch.bfloat16),
                                                         packed, BLOCK, sz)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    want = ((v.float() - 8) * scale[:, None] + zero[:, None]).sum(dim=1)
    return out.shape == (1, rows) and torch.allclose(out.float()[0], want, rtol=1e-2)


KERNEL_ROWS = 16     # the kernel packs output rows in groups of 16; other slices take the fallback
_PROBE_ROWS = 128    # rows packed to learn the kernel's layout: two or more of its row groups


@functools.lru_cache(maxsize=8)
def kernel_row_layout(inputs: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """Where the kernel's packing puts each 4-bit value of a row with `inputs` values, learned by
    packing matrices of known values (the layout is the private op's and varies with the CPU's
    vector width): (period, byte [period, inputs] int64, shift [period, inputs] uint8) such that
    value k of row r sits in the low (shift 0) or high (shift 4) nibble of byte
    (r // period) * period * inputs / 2 + byte[r % period, k] of the packed tensor; None where the
    packing is not periodic in rows that way (then rows are read from a copy; see BlockLinear.rows)."""
    n = _PROBE_ROWS * inputs
    index = torch.arange(n, dtype=torch.int64).view(_PROBE_ROWS, inputs)
    source = torch.zeros(n // 2, 2, dtype=torch.int64)      # per (byte, nibble): the flat index it holds
    digits = max(1, (n - 1).bit_length() + 3) // 4
    try:
        for d in range(digits):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> 4 * d) & 15).to(torch.int32), 1)
            flat = packed.reshape(-1).to(torch.int64)
            if flat.numel() * 2 != n:
                return None
            source[:, 0] |= (flat & 15) << 4 * d
            source[:, 1] |= (flat >> 4) << 4 * d
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    if not torch.equal(torch.sort(source.view(-1)).values, torch.arange(n)):
        return None                                          # not a permutation of the values
    where = torch.empty(n, dtype=torch.int64)                # per value: its (byte, nibble) position
    where[source.view(-1)] = torch.arange(n)
    byte, shift = (where // 2).view(_PROBE_ROWS, inputs), (where % 2 * 4).view(_PROBE_ROWS, inputs)
    for period in (KERNEL_ROWS, 2 * KERNEL_ROWS, 4 * KERNEL_ROWS):
        step = period * inputs // 2
        offsets = torch.arange(_PROBE_ROWS // period).repeat_interleave(period)[:, None] * step
        base = byte[:period].repeat(_PROBE_ROWS // period, 1) + offsets
        if torch.equal(base, byte) and torch.equal(shift[:period].repeat(_PROBE_ROWS // period, 1), shift):
            return period, byte[:period].contiguous(), shift[:period].to(torch.uint8).contiguous()
    return None


class BlockLinear(InferenceMatrix):
    """y = x @ w.T with w held in the file's blocks (see the module docstring); stands in for
    inference.InferenceLinear (forward for any leading dims, mm for 2-D x), as quantize.Int8Linear does.

    Its tensors are parameters (requires_grad=False), so parallel.weight_bytes counts them and
    offload.py packs them."""

    def __init__(self, blocks: "Blocks | Planes", device: str | torch.device = "cpu", bias: torch.Tensor | None = None,
                 rows: bool = False, activations: BlockActivations | None = None):
        """bias: kept beside the blocks in its own dtype (the fused q/k/v of a model with
        attention biases), added after the matmul. rows: the matrix is also read by rows (an
        embedding table: see rows()). activations: a GGUF file's blocks on a CPU run on the
        block-dot kernel (block_dot.py) with activations quantized so, where it builds; None:
        torch's int4 kernel."""
        super().__init__()
        planes = blocks if isinstance(blocks, Planes) else Planes(blocks.qtype, *int4_planes(blocks))
        self.qtype, self.group = planes.qtype, planes.group
        self.twice = planes.twice                   # the input runs once per plane
        values, scale, zero = planes.values, planes.scale, planes.zero
        self.out_features, self.in_features = values.shape[0], values.shape[1] // (2 if self.twice else 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        v = torch.from_numpy(values)
        # the file's own float16 scales (Q8_0, Q4_0, Q4_1; not quantize.py's INT8, whose float32
        # scales may not fit float16) on a CPU, in whole tiles of rows
        self.activations = activations if (
            activations is not None and planes.qtype in NATIVE and planes.group == BLOCK
            and torch.device(device).type == "cpu" and self.out_features % block_dot.TILE == 0
            and block_dot.available()) else None
        self.kernel = False
        if self.activations is not None:
            scale_t = torch.from_numpy(scale)
            packed, dot_scale, dot_low = block_dot.pack(v, scale_t, torch.from_numpy(zero) - 8 * scale_t)
            self.packed = nn.Parameter(packed, requires_grad=False)
            self.dot_scale = nn.Parameter(dot_scale, requires_grad=False)
            self.dot_low = nn.Parameter(dot_low, requires_grad=False)
            self.layout = self.row_copy = None
            return
        # [blocks, rows, 2]: the kernel's layout of the scales and zeros
        sz = torch.stack([torch.from_numpy(scale).t(), torch.from_numpy(zero).t()], dim=-1)
        self.kernel = (torch.device(device).type == "cpu" and self.out_features % KERNEL_ROWS == 0
                       and cpu_kernel_runs())
        if self.kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(v.to(torch.int32), 1)
        else:
            packed = (v[:, 0::2] | (v[:, 1::2] << 4)).to(device)    # two values a byte, ours
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(sz.to(device=device, dtype=torch.bfloat16).contiguous(),
                                             requires_grad=False)
        # rows=True (an embedding table, tied to the head or not): where its rows cannot be read
        # from the kernel's packing, a copy in our own layout serves the lookups
        self.layout = self._row_layout(values) if self.kernel and rows else None
        self.row_copy = None
        if rows and self.kernel and self.layout is None:
            self.row_copy = nn.Parameter((v[:, 0::2] | (v[:, 1::2] << 4)).to(device), requires_grad=False)

    def _row_layout(self, values: np.ndarray):
        """kernel_row_layout for this matrix, checked against its own values on a few rows."""
        layout = kernel_row_layout(values.shape[1])
        if layout is None or self.out_features % layout[0]:
            return None
        self.layout = layout
        probe = torch.tensor(sorted({0, self.out_features // 2 + 1, self.out_features - 1}))
        return layout if torch.equal(self._values(probe), torch.from_numpy(values[probe.numpy()])) else None

    def _values(self, ids: torch.Tensor) -> torch.Tensor:
        """The 4-bit values (uint8 [len(ids), inputs']) of rows `ids`, read from the packing."""
        if not self.kernel:
            p = self.packed[ids]
        elif self.layout is None:
            p = self.row_copy[ids]
        else:
            period, byte, shift = self.layout
            at = byte[ids % period] + (ids // period * (period * byte.shape[1] // 2))[:, None]
            return (self.packed.view(-1)[at] >> shift[ids % period]) & 15
        return torch.stack([p & 15, p >> 4], dim=-1).view(p.shape[0], -1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the matrix, dequantized: [*ids.shape, in] in `dtype`.
        An embedding lookup reads only these rows' blocks (needs rows=True where the kernel runs)."""
        flat = ids.reshape(-1)
        if self.activations is not None:
            v = block_dot.unpack_rows(self.packed, flat).to(dtype).view(flat.numel(), -1, BLOCK)
            scale, low = (block_dot.by_rows(t, flat).to(dtype)[..., None] for t in (self.dot_scale, self.dot_low))
            w = v * scale + low
        else:
            v = self._values(flat).to(dtype)
            sz = self.scales_and_zeros[:, flat].to(dtype)                     # [blocks, n, 2]
            w = (v.view(flat.numel(), -1, self.group) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        w = w.view(flat.numel(), -1)
        if self.twice:
            w = w[:, :self.in_features] + w[:, self.in_features:]
        return w.view(*ids.shape, self.in_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] matrix these blocks stand for (the fallback path; tests)."""
        if self.kernel:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            return self._matmul(eye).t().to(dtype)
        return self.rows(torch.arange(self.out_features, device=self.packed.device), dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype."""
        y = self._matmul(x)
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            x2 = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            if self.twice:
                x2 = torch.cat([x2, x2], dim=1)
            return block_dot.mm(x2, self.packed, self.dot_scale, self.dot_low,
                                self.activations is BlockActivations.FINE).to(x.dtype)
        if not self.kernel:
            return F.linear(x, self.dequantized(x.dtype))
        xb = x.to(torch.bfloat16)
        if self.twice:
            xb = torch.cat([xb, xb], dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed, self.group,
                                                       self.scales_and_zeros)
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class BlockEmbedding(nn.Module):
    """Token embeddings read from a BlockLinear's rows (rows=True): only the looked-up rows are
    dequantized, into the model's dtype. A tied model's embedding and LM head are one BlockLinear."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype)
