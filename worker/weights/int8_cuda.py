"""Weight-only INT8 on CUDA (`--quantize int8`): y = x @ (q * scale).T with the int8 matrix read by
the kernel itself, so no dequantized temporary of each matrix is written and read back per step.

One Triton kernel for every row count: each program computes BLOCK_N outputs of one row of x,
walking the inputs one scale group at a time (int8 tile -> float, times x, summed, times the
group's scale per output). Decode (a few rows) is what it is for: it reads the int8 matrix once per
row of x, so a prefill of many rows takes the cast-and-matmul path instead (ROWS_FUSED).

Unproven on a GPU: written and checked for correctness with Triton's interpreter on a CPU
(TRITON_INTERPRET=1, tests/worker/weights/test_quantize.py), never timed on a device. Guarded:
it runs only where Triton imports and the kernel reproduces a small product once per process;
otherwise the cast path runs as before.
"""
from __future__ import annotations

import functools
import os

import torch

ROWS_FUSED = 16        # more rows of x than this: cast the matrix once and run one matmul
BLOCK_N = 64

try:
    import triton
    import triton.language as tl
except ImportError:                      # a CPU-only install: the cast path
    triton = None

if triton is not None:
    @triton.jit
    def _int8_gemv(x_ptr, q_ptr, s_ptr, y_ptr, n, k, groups, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n
        inner = tl.arange(0, GROUP)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for g in range(0, groups):
            xs = tl.load(x_ptr + row * k + g * GROUP + inner).to(tl.float32)
            w = tl.load(q_ptr + cols[:, None] * k + g * GROUP + inner[None, :], mask=mask[:, None], other=0)
            part = tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
            acc += part * tl.load(s_ptr + cols * groups + g, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def int8_matmul_cuda(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (rows <= ROWS_FUSED) times int8 q [out, in] with scales [out, groups] (any float dtype)
    -> [rows, out] in x's dtype."""
    rows, k = x.shape
    n, groups = scales.shape
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _int8_gemv[(rows, triton.cdiv(n, BLOCK_N))](x, q, scales, y, n, k, groups, GROUP=k // groups, BLOCK_N=BLOCK_N)
    return y


@functools.lru_cache(maxsize=None)
def cuda_kernel_runs() -> bool:
    """Whether the kernel runs here and matches the cast path on a small product (checked once)."""
    if triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (96, 128), generator=gen, dtype=torch.int8).to(device)
        scales = (torch.rand(96, 2, generator=gen) / 100).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(3, 128, generator=gen).to(device)
        want = x @ (q.float().view(96, 2, 64) * scales.float()[..., None]).view(96, 128).t()
        got = int8_matmul_cuda(x, q, scales)
    except Exception:  # noqa: BLE001 - any compiler or driver failure means: use the cast path
        return False
    return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
