"""A normal request's latency on `shardwise serve` while hostile clients hold connections.

    python benchmarks/http_abuse_bench.py [--model smollm2] [--idle 3000] [--abandoned 300] [--rounds 5]

Starts `shardwise serve --model MODEL` on 127.0.0.1 (any free port) and measures the latency of a
normal request (/v1/completions, --max-tokens greedy tokens; the median of --rounds):

  1. idle: nothing else connected;
  2. with --idle connections open that never send a byte (those the server closes after its 10 s
     idle timeout are opened again, every second);
  3. with those, and --abandoned chat requests without max_tokens (each asks for the whole rest
     of the context) sent on their own connections, which are closed --abandon-after seconds
     later, their answers never read.

It prints each latency, its ratio to the idle one (the mean of phase 1 and of the same measure
taken again at the end; the aim: within 2x), and the server's thread count in each phase; for
phase 3 also how many of the abandoned requests the bounded queue refused (429, --max-waiting)
and how long the engine took to be idle again once their clients had gone.
Loopback only; every loop is bounded in count and in time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(model: str, log) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "shardwise", "serve", "--model", model, "--host", HOST, "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log)
    deadline = time.monotonic() + 600
    port = None
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log.name) as f:
            text = f.read()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        if m and port is None:
            port = int(m.group(1))
        if port is not None:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=5) as r:
                    if r.status == 200:
                        return proc, port
            except OSError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready:\n{open(log.name).read()[-3000:]}")


def normal_request(port: int, max_tokens: int) -> float:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] >= 1, out
    return time.perf_counter() - t0


def latency(port: int, rounds: int, max_tokens: int) -> float:
    return statistics.median(normal_request(port, max_tokens) for _ in range(rounds))


def engine_gauges(port: int) -> dict[str, float]:
    """The engine's running and waiting requests and the requests refused so far, from /metrics."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    names = ("shardwise_running_requests", "shardwise_waiting_requests", "shardwise_rejected_requests_total")
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) (\S+)$", text, re.M) if m.group(1) in names}


def seconds_to_idle(port: int, limit: float = 120) -> float:
    """Seconds until the engine has nothing running or waiting (at most `limit`)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        g = engine_gauges(port)
        if not g["shardwise_running_requests"] and not g["shardwise_waiting_requests"]:
            break
        time.sleep(0.05)
    return time.perf_counter() - t0


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def open_idle(port: int, count: int) -> list[socket.socket]:
    socks = []
    deadline = time.monotonic() + 60
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        try:
            socks.append(socket.create_connection((HOST, port), timeout=10))
        except OSError as e:
            print(f"  connection {len(socks)}: {e}", file=sys.stderr)
            break
    return socks


class IdleHolder:
    """`count` idle connections kept open: the ones the server closes (its idle timeout) are
    opened again every second, until stop(). Bounded: at most `count` connections, and
    `seconds` in all."""

    def __init__(self, port: int, count: int, seconds: float = 600):
        self.port, self.count, self.until = port, count, time.monotonic() + seconds
        self.socks = open_idle(port, count)
        self.stopping = threading.Event()
        self.reopened = 0
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.thread.start()

    def _keep(self) -> None:
        while not self.stopping.wait(1.0) and time.monotonic() < self.until:
            alive = []
            for s in self.socks:
                try:
                    if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            fresh = open_idle(self.port, self.count - len(alive))
            self.reopened += len(fresh)
            self.socks = alive + fresh

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)
        close_all(self.socks)


def send_abandoned(port: int, count: int) -> list[socket.socket]:
    """Chat requests without max_tokens (the rest of the context each), not read."""
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story about a river."}],
                       "temperature": 0}).encode()
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    socks = []
    for _ in range(count):
        try:
            s = socket.create_connection((HOST, port), timeout=10)
            s.sendall(raw)
            socks.append(s)
        except OSError as e:
            print(f"  abandoned request {len(socks)}: {e}", file=sys.stderr)
            break
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--idle", type=int, default=3000, help="idle connections held open")
    ap.add_argument("--abandoned", type=int, default=300, help="full-context requests sent and abandoned")
    ap.add_argument("--abandon-after", type=float, default=0.5, help="seconds before they are closed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    # both ends of every connection are file descriptors of this machine (the server inherits this)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * (args.idle + args.abandoned) + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc, port = start_server(args.model, log)
        try:
            normal_request(port, args.max_tokens)          # warm up
            idle = latency(port, args.rounds, args.max_tokens)
            print(f"idle:                      {idle * 1000:8.1f} ms   threads {threads(proc.pid)}")
            held = IdleHolder(port, args.idle)
            time.sleep(0.5)
            with_idle = latency(port, args.rounds, args.max_tokens)
            print(f"{len(held.socks)} idle connections: {with_idle * 1000:8.1f} ms   x{with_idle / idle:.2f}   "
                  f"threads {threads(proc.pid)}   ({held.reopened} reopened after the server closed them)")
            refused = engine_gauges(port).get("shardwise_rejected_requests_total", 0)
            sent = send_abandoned(port, args.abandoned)
            time.sleep(args.abandon_after)
            queued = engine_gauges(port)
            refused = queued.get("shardwise_rejected_requests_total", 0) - refused
            close_all(sent)
            freed = seconds_to_idle(port)
            print(f"abandoned: {queued['shardwise_running_requests']:.0f} running and "
                  f"{queued['shardwise_waiting_requests']:.0f} waiting, {refused:.0f} refused with 429; "
                  f"the engine idle {freed:.2f} s after their clients closed")
            t0 = time.perf_counter()
            both = latency(port, args.rounds, args.max_tokens)
            print(f"{len(held.socks)} idle + {len(sent)} abandoned: {both * 1000:8.1f} ms   x{both / idle:.2f}   "
                  f"threads {threads(proc.pid)}   (measured {time.perf_counter() - t0:.1f} s)")
            held.stop()
            time.sleep(1)
            after = latency(port, args.rounds, args.max_tokens)
            print(f"idle again:                {after * 1000:8.1f} ms   threads {threads(proc.pid)}")
            base = (idle + after) / 2       # a busy machine drifts: the mean of before and after
            print(f"ratio to idle: {with_idle / base:.2f} (idle connections), {both / base:.2f} (and abandoned)")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        sys.stdout.flush()
        errors = [line for line in open(log.name) if "Traceback" in line or "req-" in line]
        if errors:
            print("server errors:\n" + "".join(errors[:20]))


if __name__ == "__main__":
    main()
