"""The block-dot kernel (block_dot.cpp): a GGUF file's 4-bit blocks multiplied by activations
quantized on the fly per block of 32, with integer dot products, as llama.cpp multiplies them.

torch has no such product on a CPU: its int4 kernel (`aten._weight_int4pack_mm_for_cpu`, which the
blocks otherwise run on) dequantizes every block inside every row's product, in bfloat16. This one
multiplies the 4-bit values as they are, 32 lanes of u8 x s8 at a time (AVX2, or AVX-VNNI /
AVX512-VNNI where the CPU has them), 1.6-2.5x faster at every batch size on the development
machine (docs/worker.md, "Where the CPU's time goes"). Two activation precisions
(crds/modelshape.py BlockActivations, the worker's --block-activations):

  fine  (default) each value as d / 128 * (128 q1 + q2): 14 bits, more precise than the int4
        kernel's bfloat16 activations, two integer dot products per block;
  int8  each value as d * q1 (llama.cpp's Q8 activations): one dot product, faster, and
        SmolLM2-135M's perplexity +0.9% (its greedy text changes).

A row's result depends on that row alone (no cross-row reduction), so a prompt gives the same
values whichever rows share its step.

The kernel is C++ built on first use with the machine's C++ compiler against the installed torch
(about 10 s), into ~/.cache/shardwise/kernels (or $SHARDWISE_KERNEL_DIR, where the worker image
ships it prebuilt), under a name that changes with the source and the torch version. Where it
cannot be built or loaded (no compiler, not x86-64 with AVX2, another torch ABI) `available()` is
False, one line says why, and the blocks run on torch's int4 kernel as before.

This module imports only torch and the standard library: the worker image's build runs it as a
script (`python block_dot.py --build DIR`) before shardwise is installed.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("block_dot.cpp")
DIR_ENV = "SHARDWISE_KERNEL_DIR"
BLOCK = 32          # inputs per block (block_dot.cpp QK)
TILE = 8            # weight rows per tile (block_dot.cpp TILE): a matrix's rows a multiple of it
BUILD_TIMEOUT_S = 300


def _flags() -> list[str]:
    return ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def library_name() -> str:
    """The built file's name: it changes with the source, the flags, torch's version and the machine."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*_flags(), torch.__version__, platform.machine()]).encode())
    return f"block_dot-{digest.hexdigest()[:16]}.so"


def search_dirs() -> list[Path]:
    dirs = [Path(os.environ[DIR_ENV])] if os.environ.get(DIR_ENV) else []
    return dirs + [Path.home() / ".cache" / "shardwise" / "kernels"]


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(out_dir: Path) -> Path:
    """Compile block_dot.cpp into out_dir (atomically, under a lock: the ranks of one host may ask at
    once); returns the library's path. Raises RuntimeError with the compiler's last line."""
    from torch.utils.cpp_extension import include_paths     # imports setuptools: only when building
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++; $CXX names another)")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name()
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        torch_lib = Path(torch.__file__).parent / "lib"
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, *_flags(), *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", tmp,
               f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise RuntimeError(f"{Path(cxx).name} failed: {(errors or ['no output'])[0][:300]}")
            os.chmod(tmp, 0o755)        # mkstemp's 0600 would keep other users (the image's) out
            os.replace(tmp, target)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(cxx).name} took over {BUILD_TIMEOUT_S} s") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _supported_machine() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is for x86-64, this machine is {platform.machine()}"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
    except OSError:
        return None                                          # let the probe decide
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether torch.ops.shardwise_blocks.mm runs here: loaded from a built library, built first
    where none is (once per process); checked on a small product against its definition."""
    why = _supported_machine()
    if why is None:
        try:
            name = library_name()                            # hashes the source: once
            path = next((d / name for d in search_dirs() if (d / name).exists()), None)
            if path is None:
                path = build(search_dirs()[-1])
            torch.ops.load_library(str(path))
            why = _probe()
        except (RuntimeError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    if why is not None:
        print(f"shardwise: GGUF blocks run on torch's int4 kernel, not the block-dot kernel: {why}",
              file=sys.stderr, flush=True)
    return why is None


def pack(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit values uint8 [N, K] (0..15) and float [N, K / 32] scale and low (w = v * scale + low per
    block) -> the kernel's layout: v uint8 [N / 8, K / 32, 4, 8, 4] (chunk c holds, per row of the
    tile, inputs 4c..4c+3 in the low nibbles and 4c+16..4c+19 in the high ones), scale and low
    float16 [N / 8, K / 32, 8]."""
    n, k = values.shape
    b = k // BLOCK
    tiled = values.view(n // TILE, TILE, b, 8, 4).permute(0, 2, 3, 1, 4)      # [tile, block, group, row, 4]
    v = (tiled[:, :, :4] | (tiled[:, :, 4:] << 4)).contiguous()

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).view(n // TILE, TILE, b).permute(0, 2, 1).contiguous()
    return v, by_tile(scale), by_tile(low)


def unpack_rows(v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The 4-bit values (uint8 [len(rows), K]) of `rows` from pack()'s layout."""
    tiles = v[rows // TILE]                                           # [n, B, 4, 8, 4]
    mine = tiles[torch.arange(len(rows)), :, :, rows % TILE]          # [n, B, 4, 4]
    return torch.cat([mine & 15, mine >> 4], dim=2).reshape(len(rows), -1)


def by_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of pack()'s per-tile scale or low: [len(rows), K / 32]."""
    return t[rows // TILE, :, rows % TILE]


def mm(x: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, fine: bool = True) -> torch.Tensor:
    """x float32 or bfloat16 [M, K] @ w.T for w packed by pack() -> float32 [M, N]; fine: each
    activation in two int8 levels (BlockActivations.FINE), else one."""
    return torch.ops.shardwise_blocks.mm(x.contiguous(), v, scale, low, fine)


def _probe() -> str | None:
    """None if the loaded kernel computes its definition on a small product, else why not."""
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=g)
    scale = torch.rand(16, 2, generator=g).half().float() / 8
    low = -torch.rand(16, 2, generator=g).half().float()
    x = torch.randn(3, 64, generator=g)
    w = (values.float().view(16, 2, BLOCK) * scale[..., None] + low[..., None]).view(16, 64)
    try:
        y = mm(x, *pack(values, scale, low))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    want = x @ w.t()
    return None if torch.allclose(y, want, rtol=1e-3, atol=1e-3) else "its results differ from the definition"


def main(argv: list[str]) -> int:
    """python block_dot.py --build DIR: build the library into DIR (the worker image's build)."""
    if len(argv) != 2 or argv[0] != "--build":
        print("usage: python block_dot.py --build DIR", file=sys.stderr)
        return 2
    try:
        print(build(Path(argv[1])))
    except RuntimeError as e:
        print(f"block_dot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
