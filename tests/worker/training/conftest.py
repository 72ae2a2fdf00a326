"""What the training tests share: a corpus and the tiny random model trained on it
(tests/worker/conftest.py: corpus, tiny_model), and `shardwise train` run on them as real local
processes.

Fixtures:
  work        a folder per test module: data.txt (the corpus) and model/ (4 layers, 64 wide)
  train       `shardwise train --model <work>/model --data <work>/data.txt --checkpoint-dir CKDIR`
              followed by the test module's COMMON arguments and the call's own (a later option
              overrides an earlier one, e.g. "--steps", "4"): .command(), .run() to its end,
              .start() in the background, .ranks() of a started run, .records() of its stdout
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest


class TrainRun(NamedTuple):
    code: int
    records: dict[int, dict]
    stderr: str


@dataclass
class TrainCommand:
    work: Path
    common: tuple[str, ...] = ()

    def command(self, ckdir: Path, *args: str, model: Path | None = None) -> list[str]:
        return [sys.executable, "-m", "shardwise", "train", "--model", str(model or self.work / "model"),
                "--data", str(self.work / "data.txt"), "--checkpoint-dir", str(ckdir), *self.common, *args]

    def run(self, ckdir: Path, *args: str, model: Path | None = None, env: dict | None = None,
            timeout: int = 300, check: bool = False) -> TrainRun:
        """Run to the end; `check`: the run must succeed (its stderr is the failure's message)."""
        p = subprocess.run(self.command(ckdir, *args, model=model), capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, **(env or {})})
        if check:
            assert p.returncode == 0, p.stderr
        return TrainRun(p.returncode, self.records(p.stdout), p.stderr)

    def start(self, ckdir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(ckdir, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **(env or {})})

    @staticmethod
    def records(stdout: str) -> dict[int, dict]:
        """step -> that step's record, from the stdout of `--json` (every line one JSON object)."""
        return {rec["step"]: rec for rec in map(json.loads, stdout.splitlines())}

    @staticmethod
    def ranks(pid: int) -> dict[int, int]:
        """rank -> pid of the local ranks started by the launcher `pid` (named shardwise-rk<N>)."""
        found, todo = {}, [pid]
        while todo:
            p = todo.pop()
            try:
                kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                try:
                    comm = Path(f"/proc/{k}/comm").read_text().strip()
                except OSError:
                    continue
                if comm.startswith("shardwise-rk"):
                    found[int(comm[len("shardwise-rk"):])] = k
                todo.append(k)
        return found


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model, corpus) -> Path:
    root = tmp_path_factory.mktemp("train")
    (root / "data.txt").write_text(corpus)
    tiny_model(root / "model", layers=4, hidden=64, heads=4, kv_heads=2)
    return root


@pytest.fixture(scope="module")
def train(request, work) -> TrainCommand:
    return TrainCommand(work, tuple(getattr(request.module, "COMMON", ())))
