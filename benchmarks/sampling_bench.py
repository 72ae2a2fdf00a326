"""What choosing the next tokens costs the engine per step: the Sampler (worker/serving/sampling.py)
on one step's logits, 32 rows over a 49,152-token vocabulary (SmolLM2's), in microseconds.

    python3 benchmarks/sampling_bench.py [--rows 32] [--vocab 49152] [--runs 30] [--json]
    python3 benchmarks/ab.py --base <rev> --lower ... -- benchmarks/sampling_bench.py --json

Kinds of rows, each a whole batch: greedy (temperature 0; also one row alone), temperature 0.8,
temperature with top-p 0.9 (the OpenAI clients' usual pair), temperature with top-k 50, and a
mix of all of them with logprobs (5 alternatives) asked by a quarter of the rows. Every sampled
row is seeded, as a seeded request is the costlier kind (its own generator). Logits are float32 on
the CPU as the last stage hands them over; the median of --runs steps, each timed as the thread's
CPU time (time.thread_time, so other processes on a busy machine do not count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardwise.worker.serving.request import Request
from shardwise.worker.serving.sampling import Sampler


def kinds(rows: int) -> dict[str, list[dict]]:
    mixed = [dict(), dict(temperature=0.8), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=50)]
    return {
        "greedy_1": [dict()],
        "greedy": [dict()] * rows,
        "temperature": [dict(temperature=0.8)] * rows,
        "top_p": [dict(temperature=0.7, top_p=0.9)] * rows,
        "top_k": [dict(temperature=1.0, top_k=50)] * rows,
        "mixed_logprobs": [dict(mixed[i % 4], logprobs=5 if i % 4 == 0 else None) for i in range(rows)],
    }


def time_kind(params: list[dict], vocab: int, runs: int) -> float:
    """Median microseconds of one Sampler call on a fresh step's logits."""
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(len(params), vocab, generator=g) * 4 for _ in range(4)]
    sampler = Sampler()
    reqs = [Request([1], seed=i if p.get("temperature") else None, **p) for i, p in enumerate(params)]
    sampler(logits[0], reqs)                              # first-call set-up out of the timing
    times = []
    for i in range(runs):
        x = logits[i % len(logits)]
        t0 = time.thread_time()
        sampler(x, reqs)
        times.append((time.thread_time() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {name: round(time_kind(p, args.vocab, args.runs), 1) for name, p in kinds(args.rows).items()}
    if args.json:
        print(json.dumps({"sampling_us": result}))
    else:
        for name, us in result.items():
            print(f"{name:16s} {us:10.1f} us per step of {args.rows if name != 'greedy_1' else 1} rows")


if __name__ == "__main__":
    main()
