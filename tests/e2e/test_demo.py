"""`shardwise demo`: the one-line refusals of layouts SmolLM2 cannot take (no cluster needed).

The demo's full run (`shardwise demo --chaos`: a fresh local cluster with local nodes, the operator,
SmolLM2 at tensor 1 × pipeline 2, a completion, a node lost, recovery, a second completion, and
nothing left running afterwards) is the last command of the README's quick start, so it is run and
checked once, by tests/e2e/test_readme.py, which replays the quick start in a fresh clone, virtual
environment and HOME; see check_demo_chaos_output there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "shardwise", "demo"]


def _demo(args: list[str], state_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDWISE_DEV_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(DEMO + args, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["--tensor-parallel", "2"], "--tensor-parallel 2 does not divide"),
    (["--tensor-parallel", "1", "--pipeline-parallel", "1"], "tensor × pipeline is 1 × 1"),
    (["--pipeline-parallel", "31"], "--pipeline-parallel 31 is more than"),
])
def test_layouts_smollm2_cannot_take_are_refused_in_one_line(tmp_path, args, says):
    proc = _demo(args, tmp_path / "dev", timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "dev").exists()  # refused before anything started
