"""What one mixed step costs: running decodes and a fresh prompt in one ragged step, the prompt's
first chunk attending through SDPA's causal kernel over its own keys (the engine's way) against
through the masked product over the cache (the way before), and against the two as separate
steps. The built-in model, one rank; the kinds of step are timed in alternating rounds and the
fastest of each kept, so a shared machine's load moves all of them alike.

    python benchmarks/ragged_step_bench.py [--decodes 4] [--prompt 400] [--rounds 7]
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--context", type=int, default=200, help="tokens each decoding row has cached")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    from shardwise.worker.serving.cache_view import ragged_view
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec
    bs, d, p, ctx_len = 16, args.decodes, args.prompt, args.context
    with LocalRuntime(RankSpec(args.model, max_batch=d + 1, max_seq=1024)) as ctx:
        model = ctx.stage.model
        model.setup_caches((d + 1) * 64, 1024, bs, device=ctx.stage.device)
        tables = [[r * 64 + i for i in range(64)] for r in range(d + 1)]

        def step(counts, starts, rows, causal_fresh=True):
            positions = torch.tensor([s + i for c, s in zip(counts, starts) for i in range(c)])
            blocks = torch.tensor([tables[r] for r in rows])
            tokens = torch.randint(3, 1000, (1, sum(counts)))
            with torch.no_grad():
                t0 = time.perf_counter()
                cache = ragged_view(model, counts, positions, blocks, causal_fresh=causal_fresh)
                model(tokens, positions=positions[None], cache=cache, return_hidden=True)
                return time.perf_counter() - t0

        mixed = ([1] * d + [p], [ctx_len] * d + [0], list(range(d + 1)))
        best = {"mixed, causal kernel": 1e9, "mixed, masked (before)": 1e9, "decodes alone": 1e9,
                "prompt alone": 1e9}
        for _ in range(args.rounds):
            best["mixed, causal kernel"] = min(best["mixed, causal kernel"], step(*mixed))
            best["mixed, masked (before)"] = min(best["mixed, masked (before)"], step(*mixed, causal_fresh=False))
            best["decodes alone"] = min(best["decodes alone"], step([1] * d, [ctx_len] * d, list(range(d))))
            best["prompt alone"] = min(best["prompt alone"], step([p], [0], [d]))
        for name, t in best.items():
            print(f"{name:24s} {t * 1e3:8.1f} ms")
        apart = best["decodes alone"] + best["prompt alone"]
        print(f"mixed / apart: causal kernel {best['mixed, causal kernel'] / apart:.2f}x, "
              f"masked {best['mixed, masked (before)'] / apart:.2f}x; "
              f"masked / causal {best['mixed, masked (before)'] / best['mixed, causal kernel']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
