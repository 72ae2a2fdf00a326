"""A real `shardwise serve` process for the tests that talk to it over HTTP: started, waited for
until /healthz answers, and stopped however the test ends."""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from shardwise.e2e import processes

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def listening(cmd: list[str], stop_seconds: float = 30) -> Iterator[tuple[str, list[str], subprocess.Popen]]:
    """Run `cmd` (a shardwise server), wait for its "listening on URL" line: yields the URL, its stderr
    lines so far (the list keeps growing while it runs) and the process; stopped however the test ends."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    base = None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            base = m.group(1)
            break
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        assert base, "".join(lines)
        yield base, lines, proc
    finally:
        processes.stop(proc, stop_seconds)


@contextlib.contextmanager
def serve_process(args: list[str], ready_seconds: float = 120) -> Iterator[tuple[str, list[str]]]:
    """`shardwise serve ARGS` (give it `--port 0`): yields its base URL and its stderr lines so far
    (the list keeps growing while it runs), once /healthz answers."""
    with listening([sys.executable, "-m", "shardwise", "serve", *args]) as (base, lines, proc):
        deadline = time.monotonic() + ready_seconds
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
                time.sleep(0.2)
        yield base, lines
