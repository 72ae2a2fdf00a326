"""Graceful drain of `shardwise serve` (worker/serving/http/server.py run_engine): on SIGTERM the server turns
unready, refuses new requests with 503 and Retry-After, and the requests already streaming run to
their end before it exits. A real server process, TP 2, streaming over HTTP."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .test_server import _get

ROOT = Path(__file__).resolve().parents[3]
NEW_TOKENS = 120


def _stream(base: str, out: dict, tokens: int = NEW_TOKENS) -> None:
    """One streamed completion; records its chunks' text, the finish reason and any error."""
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    out["chunks"] = []
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:           # ended mid-stream (the server says why)
                        out["error"] = chunk["error"]["message"]
                    elif chunk["choices"]:
                        out["chunks"].append(chunk["choices"][0])
                        out.setdefault("first_at", time.monotonic())
                    else:
                        out["usage"] = chunk["usage"]
                elif line == "data: [DONE]":
                    out["done"] = True
    except Exception as e:  # noqa: BLE001 - the test reports it
        out["error"] = f"{type(e).__name__}: {e}"


def test_sigterm_drains_streaming_requests_and_refuses_new_ones(tiny_serving_model):
    model = tiny_serving_model
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", "--model", str(model), "-t", "2",
                             "--port", "0", "--max-seq-len", "256", "--threads", "1"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        base = None
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                base = m.group(1)
                break
        assert base
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while _get(base + "/healthz")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log
            time.sleep(0.2)
        out: dict = {}
        streaming = threading.Thread(target=_stream, args=(base, out))
        streaming.start()
        while "first_at" not in out:
            assert streaming.is_alive(), out
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status, body = _get(base + "/healthz")
        assert status == 503 and json.loads(body)["status"] == "draining"
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps({"prompt": "x"}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("a new request was accepted while draining")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and e.headers["Retry-After"] == "1"
            assert "shutting down" in json.loads(e.read())["error"]["message"]
        streaming.join(60)
        assert "error" not in out and out.get("done"), out
        assert out["chunks"][-1]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == NEW_TOKENS
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
