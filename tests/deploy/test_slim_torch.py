"""docker/slim_torch.py on a synthetic site-packages built from real host ELF libraries: libpng16 stands
in for a torch library (it DT_NEEDs libz.so.1), libz for the nvidia library it links against, libbz2 for
one nothing links against, and libssl (DT_NEEDs libcrypto.so.3) for libtorch_cuda_linalg.so, which torch
dlopens lazily and so must not keep its dependencies."""
from __future__ import annotations
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "slim_torch.py"
HOST = [Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu")]


def host_lib(name: str) -> Path:
    for d in HOST:
        if (d / name).exists():
            return (d / name).resolve()
    pytest.skip(f"host library {name} not found")


def slim(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(site), *args], capture_output=True, text=True)


def test_keeps_the_linked_closure_and_removes_the_rest(tmp_path):
    layout = {"torch/lib/libtorch_cpu.so": "libpng16.so.16", "torch/lib/libtorch_cuda_linalg.so": "libssl.so.3",
              "nvidia/zlib/lib/libz.so.1.2.13": "libz.so.1", "nvidia/ssl/lib/libcrypto.so.3": "libz.so.1",
              "nvidia/bz/lib/libbz2.so.1.0": "libbz2.so.1.0"}
    sources = {dest: host_lib(src) for dest, src in layout.items()}
    for dest, src in sources.items():
        (tmp_path / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / dest)
    (tmp_path / "torch/lib/libnotelf.so").write_text("not an ELF file")
    for f in ("nvidia/bz/__init__.py", "nvidia_bz-1.0.dist-info/METADATA", "triton/__init__.py",
              "triton-3.0.0.dist-info/METADATA"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")

    dry = slim(tmp_path, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert all((tmp_path / dest).exists() for dest in layout) and (tmp_path / "triton").exists()

    run = slim(tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == dry.stdout.replace("slim_torch: dry run, nothing is deleted\n", "")
    assert run.stdout.splitlines()[-1].startswith("slim_torch: removed 4 files, ")
    assert (tmp_path / "nvidia/zlib/lib/libz.so.1.2.13").exists()
    assert not (tmp_path / "nvidia/bz/lib/libbz2.so.1.0").exists()
    assert not (tmp_path / "nvidia/ssl/lib/libcrypto.so.3").exists()
    assert not (tmp_path / "triton").exists() and not (tmp_path / "triton-3.0.0.dist-info").exists()
    assert all((tmp_path / f).exists() for f in ("torch/lib/libtorch_cuda_linalg.so", "torch/lib/libnotelf.so",
                                                 "nvidia/bz/__init__.py", "nvidia_bz-1.0.dist-info/METADATA"))


def test_fails_in_one_line_without_torch(tmp_path):
    run = slim(tmp_path)
    assert run.returncode != 0 and run.stderr.strip() == f"slim_torch: no torch/ in {tmp_path}"
