"""The block-dot kernel (worker/weights/block_dot.py, block_dot.cpp): a GGUF file's blocks multiplied
with activations quantized per block of 32, against its definition; a row's result independent of
the rows beside it; the rows an embedding reads; built once and reused, and the int4 kernel where it
cannot be built."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.crds.modelshape import BlockActivations
from shardwise.worker.weights import block_dot
from shardwise.worker.weights.gguf_blocks import BLOCK, BlockLinear

from .test_gguf_blocks import TYPES, _blocks

pytestmark = pytest.mark.skipif(not block_dot.available(),
                                reason="the block-dot kernel does not build here (x86-64 with AVX2 and a C++ compiler)")


def _x(rows: int, inputs: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=g)
    x[:, 5] *= 30                     # an outlier channel, as real activations have
    return x


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 mode sees it: per block of 32, round(x * 127 / max|x|) * max|x| / 127."""
    b = x.double().view(x.shape[0], -1, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(d > 0, d, 1)) * d).view_as(x)


@pytest.mark.parametrize("qtype", TYPES)
def test_fine_activations_multiply_like_the_dequantized_matrix(qtype):
    """fine (the default): 14 bits an activation, so the product is the float64 product of the
    file's dequantized values to ~1e-4, ten times closer than torch's int4 kernel (bfloat16 inputs)."""
    blocks, w = _blocks(qtype, 48, 4 * BLOCK)
    lin = BlockLinear(blocks, activations=BlockActivations.FINE)
    assert lin.activations is BlockActivations.FINE
    x = _x(5, 4 * BLOCK)
    want = x.double() @ torch.from_numpy(w).double().t()
    err = ((lin(x).double() - want).norm() / want.norm()).item()
    int4 = BlockLinear(blocks)
    err_int4 = ((int4(x).double() - want).norm() / want.norm()).item()
    assert err < 2e-4 and err < err_int4 / 10, (err, err_int4)


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_activations_are_llamacpps_q8(qtype):
    """int8: each block of 32 inputs rounded to 8 bits on its own scale, then multiplied exactly."""
    blocks, w = _blocks(qtype, 48, 4 * BLOCK)
    lin = BlockLinear(blocks, activations=BlockActivations.INT8)
    x = _x(5, 4 * BLOCK)
    want = _int8_blocks(x) @ torch.from_numpy(w).double().t()
    assert torch.allclose(lin(x).double(), want, rtol=1e-4, atol=1e-4)
    plain = x.double() @ torch.from_numpy(w).double().t()
    assert not torch.allclose(lin(x).double(), plain, rtol=1e-4, atol=1e-4)   # it does quantize


@pytest.mark.parametrize("activations", list(BlockActivations))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(activations):
    """A prompt's values are the same however the scheduler batches or chunks it: bit for bit."""
    blocks, _ = _blocks("Q4_1", 64, 8 * BLOCK)
    lin = BlockLinear(blocks, activations=activations)
    x = _x(37, 8 * BLOCK).to(torch.bfloat16)
    together = lin(x)
    for i in (0, 3, 4, 36):
        assert torch.equal(lin(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(lin(x[4:12]), together[4:12])


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_read_from_the_kernels_layout_are_the_files_rows(qtype):
    """An embedding table in the kernel's layout looks up exactly the file's dequantized rows."""
    blocks, w = _blocks(qtype, 64, 4 * BLOCK)
    table = BlockLinear(blocks, rows=True, activations=BlockActivations.FINE)
    ids = torch.tensor([[0, 63, 9], [8, 7, 40]])
    got = table.rows(ids)
    assert got.shape == (2, 3, 4 * BLOCK)
    assert np.array_equal(got.reshape(-1, 4 * BLOCK).numpy(), w[ids.reshape(-1).numpy()])
    assert torch.equal(table.dequantized(), torch.from_numpy(w))


def test_the_layout_keeps_the_planners_bytes():
    """0.5 bytes a value plus the file's two float16 numbers a block: GGUF_NATIVE_BYTES."""
    from shardwise.crds.modelshape import GGUF_NATIVE_BYTES
    for qtype in TYPES:
        blocks, _ = _blocks(qtype, 64, 8 * BLOCK)
        lin = BlockLinear(blocks, activations=BlockActivations.FINE)
        held = sum(p.numel() * p.element_size() for p in lin.parameters())
        assert held == GGUF_NATIVE_BYTES[qtype] * 64 * 8 * BLOCK


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env}, cwd="/")


def test_built_once_into_the_cache_then_reused(tmp_path):
    """The first process builds the library into its cache; the next loads it without building."""
    env = {"HOME": str(tmp_path), "SHARDWISE_KERNEL_DIR": ""}
    code = "from shardwise.worker.weights import block_dot; print(block_dot.available())"
    first = _python(code, env)
    assert first.stdout.strip() == "True", first.stderr
    built = list((tmp_path / ".cache" / "shardwise" / "kernels").glob("block_dot-*.so"))
    assert [p.name for p in built] == [block_dot.library_name()]
    stamp = built[0].stat().st_mtime_ns
    again = _python(code, {**env, "CXX": "/bin/false"})          # a compiler that would fail
    assert again.stdout.strip() == "True" and again.stderr == "", again.stderr
    assert built[0].stat().st_mtime_ns == stamp


def test_the_image_builds_it_into_the_folder_it_ships(tmp_path):
    """worker.Dockerfile runs block_dot.py as a script into a folder; the worker finds it there."""
    script = Path(block_dot.__file__)
    done = subprocess.run([sys.executable, str(script), "--build", str(tmp_path / "k")], capture_output=True,
                          text=True, timeout=600, cwd="/")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == tmp_path / "k" / block_dot.library_name()
    found = _python("from shardwise.worker.weights import block_dot; print(block_dot.available())",
                    {"HOME": str(tmp_path / "home"), "SHARDWISE_KERNEL_DIR": str(tmp_path / "k"), "CXX": "/bin/false"})
    assert found.stdout.strip() == "True", found.stderr
    assert not (tmp_path / "home" / ".cache").exists()


def test_without_a_compiler_the_blocks_run_on_torchs_kernel_said_in_one_line(tmp_path):
    code = ("from shardwise.worker.weights import block_dot\n"
            "import numpy as np\n"
            "from shardwise.worker.weights.gguf_blocks import Blocks, BlockLinear, cpu_kernel_runs\n"
            "from shardwise.crds.modelshape import BlockActivations\n"
            "lin = BlockLinear(Blocks('Q4_1', np.zeros((48, 40), np.uint8)), activations=BlockActivations.FINE)\n"
            "print(block_dot.available(), lin.activations, lin.kernel == cpu_kernel_runs())\n")
    done = _python(code, {"HOME": str(tmp_path), "SHARDWISE_KERNEL_DIR": "", "CXX": "/bin/false"})
    assert done.stdout.strip() == "False None True", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch's int4 kernel" in lines[0] and "false failed" in lines[0], lines
