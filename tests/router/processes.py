"""Real processes for the router's tests: `shardwise router` and `shardwise serve` replicas on
loopback, started, waited for, and stopped however a test ends; and a small SSE client."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

from tests.worker.serving.serve_process import ROOT, listening, serve_process

__all__ = ["router_process", "serve_process", "replica_args", "post", "stream", "metric"]


def replica_args(model, port: int = 0) -> list[str]:
    return ["--model", str(model), "--port", str(port), "--max-seq-len", "1024", "--max-batch", "4",
            "--threads", "1"]


@contextlib.contextmanager
def router_process(args: list[str]) -> Iterator[tuple[str, list[str], subprocess.Popen]]:
    """`shardwise router ARGS --port 0`: yields its base URL, its stderr lines, the process."""
    cmd = [sys.executable, "-m", "shardwise", "router", "--port", "0", "--check-interval", "0.2", *args]
    with listening(cmd, stop_seconds=10) as started:
        yield started


def post(base: str, path: str, body: dict, key: str | None = None, timeout: float = 120):
    """(status, headers, parsed JSON body) of a whole answer."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def stream(base: str, path: str, body: dict, on_chunk=None, timeout: float = 120, stalls: list | None = None
           ) -> tuple[str, str]:
    """(the streamed text, how the stream ended: done, error ..., or eof) of a streamed answer;
    `on_chunk(n)` after each chunk; with `stalls`, a one-item list appended to it holds the longest
    wait for a chunk (the first one's included)."""
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, n, last = [], 0, time.monotonic()
    longest = [0.0]
    if stalls is not None:
        stalls.append(longest)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            longest[0], last = max(longest[0], time.monotonic() - last), time.monotonic()
            data = line[6:].strip()
            if data == b"[DONE]":
                return "".join(text), "done"
            obj = json.loads(data)
            if "error" in obj:
                return "".join(text), f"error {obj['error']}"
            assert "token_ids" not in json.dumps(obj)       # the router's own fields stay inside
            for c in obj["choices"]:
                text.append(c["text"] if "text" in c else c["delta"].get("content", ""))
            n += 1
            if on_chunk:
                on_chunk(n)
    return "".join(text), "eof"


def metric(base: str, name: str) -> dict[str, float]:
    """A metric's samples from /metrics: {label text: value}."""
    out = {}
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                key, _, value = line.rpartition(" ")
                out[key[len(name):]] = float(value)
    return out


def wait_until(check, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
