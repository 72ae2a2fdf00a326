"""Prefix-aware routing against round robin, on real replicas: TTFT and prompt-cache hits.

    nice -n 19 python benchmarks/router_prefix_bench.py [--model PATH] [--replicas 2] [--prompts 4]
                                                        [--requests 48] [--concurrency 4] [--rounds 2]
                                                        [--kv-cache-tokens N]

Starts `--replicas` `shardwise serve` processes (the model at --model, else a tiny random model
written for the run) and two routers in front of them, one per policy. Each round sends
`--requests` chat requests, each with one of `--prompts` long system prompts (new ones every
round, so that no round finds what an earlier one cached) and a question of its own, through each
router in turn; it reads each answer's time to first token and `cached_tokens`. Prints TTFT p50/p90
and the share of prompt tokens found in a replica's cache, per policy, and their ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly brew potent elixirs".split()


@contextlib.contextmanager
def process(args: list[str]):
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                break
        else:
            raise SystemExit(f"shardwise {args[0]} did not start")
        threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()    # keep its pipe drained
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(30)


def wait_ready(base: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{base} never became ready")


def one(base: str, system: str, question: str) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached prompt tokens) of one streamed chat request."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, usage = time.perf_counter(), None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in obj.get("choices", [])):
                first = time.perf_counter() - t0
            usage = obj.get("usage") or usage
    return first or (time.perf_counter() - t0), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def round_of(base: str, args, rnd: random.Random) -> list[tuple[float, int, int]]:
    systems = [" ".join(rnd.choice(WORDS) for _ in range(args.system_words)) for _ in range(args.prompts)]
    work = [(rnd.choice(systems), f"question {i}: " + " ".join(rnd.choice(WORDS) for _ in range(6)))
            for i in range(args.requests)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda w: one(base, *w), work))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder (default: a tiny random model written for the run)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="distinct system prompts per round")
    p.add_argument("--system-words", type=int, default=200, help="words of each system prompt")
    p.add_argument("--requests", type=int, default=48, help="requests per round and policy")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=0,
                   help="each replica's KV cache (0: the server's default, a whole context per request); "
                        "smaller than all the system prompts together, it makes where a request lands matter")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = args.model
        if model is None:
            from shardwise.worker.weights.tiny import write_tiny_model
            model = str(write_tiny_model(Path(tmp) / "tiny", " ".join(WORDS) * 50, layers=4, hidden=256, heads=8,
                                         kv_heads=4))
        replicas = [stack.enter_context(process(["serve", "--model", model, "--port", "0", "--max-seq-len", "2048",
                                                  "--max-batch", "8", "--threads", "1",
                                                  "--kv-cache-tokens", str(args.kv_cache_tokens)])) for _ in range(args.replicas)]
        for r in replicas:
            wait_ready(r)
        routers = {policy: stack.enter_context(process(["router", "--replicas", ",".join(replicas), "--port", "0",
                                                        "--policy", policy, "--check-interval", "0.2"]))
                   for policy in ("prefix", "round-robin")}
        time.sleep(1)
        rnd = random.Random(0)
        got: dict[str, list] = {k: [] for k in routers}
        for _ in range(args.rounds):
            for policy, base in routers.items():
                got[policy] += round_of(base, args, rnd)
    out = {}
    for policy, xs in got.items():
        ttft = sorted(x[0] for x in xs)
        out[policy] = {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p90_ms": ttft[int(0.9 * len(ttft))] * 1e3,
                       "cache_hit": sum(x[2] for x in xs) / max(1, sum(x[1] for x in xs))}
    a, b = out["prefix"], out["round-robin"]
    out["ratio_prefix_over_round_robin"] = {k: a[k] / b[k] if b[k] else None for k in a}
    print(f"{args.replicas} replicas, {args.prompts} system prompts of {args.system_words} words, "
          f"{args.requests} requests x {args.rounds} rounds per policy, {args.concurrency} at once")
    for policy in routers:
        o = out[policy]
        print(f"{policy:>11}: TTFT p50 {o['ttft_p50_ms']:.1f} ms, p90 {o['ttft_p90_ms']:.1f} ms, "
              f"prompt tokens found cached {o['cache_hit']:.0%}")
    r = out["ratio_prefix_over_round_robin"]
    print(f"prefix / round robin: TTFT p50 {r['ttft_p50_ms']:.2f}, p90 {r['ttft_p90_ms']:.2f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
