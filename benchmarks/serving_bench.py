"""The serving engine's paged KV cache against one fixed row per request, in one run.

    python benchmarks/serving_bench.py [--model smollm2] [--system-tokens 1000] [--rounds 3]

Each figure runs on the same loaded model (one rank), the old layout and the new one through the
same engine, so the ratios compare like with like:

  1. Time to first token of a request whose system prompt (--system-tokens, from
     benchmarks/data/river.txt) another request has already left in the cache, against the same
     request with the cache cold (best of --rounds each).
  2. The largest batch that fits one cache budget (--budget-tokens) for a mix of short and long
     requests: the most requests decoding together, paged (16-token blocks) against fixed rows
     (one whole context, --max-seq-len, per request), and the mix's tokens/s.
  3. Decode tokens/s with 1, 8 and 32 requests decoding together, paged against fixed rows.
  4. Decode tokens/s of 8 requests that share the system prompt, and the cache they hold: paged
     (the prefix's blocks shared; their rows are gathered for attention, not read in place)
     against fixed rows (each request its own copy).
  5. The longest pause between two tokens of a running stream while a long prompt is prefilled,
     in chunks (--prefill-chunk) against whole.
  6. Requests arriving at a rate while others decode (--arrival-rate requests/s, Poisson, seeded):
     prompts of 32-600 tokens drawn log-uniformly (most prompts short, a few long, as chat
     traffic is), answers of 16-64 tokens; output tokens/s, time to first token p50/p99 and
     inter-token p99. Run alone with `--only-arrivals`, e.g. against the engine of another
     revision (docs/worker.md, "The token-budget scheduler").
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def engine(ctx, rows: int, paged: bool, **kw):
    from shardwise.worker.serving.engine import Engine
    block = 16 if paged else ctx.max_seq                   # a block of the whole context: fixed rows
    return Engine(ctx.stage, rows, ctx.max_seq, [], block_size=block, **kw)


def step_budget(tokens: int | None) -> dict:
    """Engine keywords for steps of up to `tokens` tokens (None: the engine's default), where the
    engine has a step budget (an engine without one runs one request's prompt chunk per step)."""
    from shardwise.worker.serving.engine import Engine
    has = "max_step_tokens" in inspect.signature(Engine).parameters
    return {"max_step_tokens": tokens} if has and tokens is not None else {}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def arrivals(ctx, text: list[int], rate: float, requests: int, rows: int, seed: int = 0,
             step_tokens: int | None = None) -> dict:
    """Requests arriving at `rate` per second (exponential gaps) into an engine of `rows` rows,
    stepped on this thread; what their users see."""
    from shardwise.worker.serving.request import Request
    rng = random.Random(seed)
    at, plan = 0.0, []
    for i in range(requests):
        at += rng.expovariate(rate)
        n = int(math.exp(rng.uniform(math.log(32), math.log(600))))
        start = rng.randrange(0, len(text) - n)
        plan.append((at, Request(text[start:start + n] + [i % 50 + 3], max_new_tokens=rng.randint(16, 64))))
    eng = engine(ctx, rows, True, **step_budget(step_tokens))
    stamps: dict[int, list[float]] = {}
    for _, r in plan:
        r.on_token = lambda req, tok: stamps.setdefault(req.id, []).append(time.perf_counter())
    t0, queued = time.perf_counter(), list(plan)
    while queued or eng.running or len(eng.waiting):
        now = time.perf_counter() - t0
        while queued and queued[0][0] <= now:
            arrival, req = queued.pop(0)
            req.created = t0 + arrival                  # time from its arrival, not from when it was built
            eng.submit(req)
        if not eng.step() and queued:
            time.sleep(max(0.0, queued[0][0] - (time.perf_counter() - t0)))
    reqs = [r for _, r in plan]
    end = max(r.finished_at for r in reqs)
    gaps = [b - a for r in reqs for a, b in zip(stamps[r.id], stamps[r.id][1:])]
    ttft = [r.first_token_at - r.created for r in reqs]
    return {"tps": sum(len(r.token_ids) for r in reqs) / (end - t0), "ttft50": percentile(ttft, 50),
            "ttft99": percentile(ttft, 99), "itl99": percentile(gaps, 99), "span": end - t0}


def print_arrivals(ctx, text: list[int], rate: float, requests: int, step_tokens: int | None = None) -> None:
    got = arrivals(ctx, text, rate, requests, 16, step_tokens=step_tokens)
    print(f"\n6. {requests} requests arriving at {rate:g}/s (Poisson), 16 rows, prompts 32-600 tokens, "
          f"16-64 new: output {got['tps']:.1f} tok/s   TTFT p50 {got['ttft50'] * 1e3:.0f} ms   "
          f"TTFT p99 {got['ttft99'] * 1e3:.0f} ms   inter-token p99 {got['itl99'] * 1e3:.0f} ms   "
          f"(all done in {got['span']:.1f} s)")


def run(eng, reqs) -> float:
    """Seconds to run `reqs` to the end, submitted together."""
    t0 = time.perf_counter()
    eng.generate(reqs)
    return time.perf_counter() - t0


def time_to_first_token(ctx, system: list[int], rounds: int) -> tuple[float, float]:
    from shardwise.worker.serving.request import Request
    cold = warm = float("inf")
    for r in range(rounds):
        eng = engine(ctx, 2, True)
        first = Request(system + [7, 8, 9 + r], max_new_tokens=1)
        run(eng, [first])
        cold = min(cold, first.first_token_at - first.created)
        second = Request(system + [10, 11, 12 + r], max_new_tokens=1)
        run(eng, [second])
        assert second.reused_tokens >= len(system) - 16, second.reused_tokens
        warm = min(warm, second.first_token_at - second.created)
    return cold, warm


def largest_batch(ctx, budget: int, text: list[int], rows: int) -> dict:
    """Peak requests decoding together, and tokens/s, for 24 short and 4 long requests."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    out = {}
    for paged in (False, True):
        if paged:
            eng = Engine(ctx.stage, rows, ctx.max_seq, [], kv_tokens=budget, block_size=16)
        else:        # the old engine: a fixed row of the whole context per request, within the budget
            eng = Engine(ctx.stage, budget // ctx.max_seq, ctx.max_seq, [], block_size=ctx.max_seq)
        reqs = [Request(text[i * 7:i * 7 + 48], max_new_tokens=32) for i in range(24)]
        reqs[::7] = [Request(text[i:i + ctx.max_seq * 3 // 4], max_new_tokens=32) for i in range(4)]
        for r in reqs:
            eng.submit(r)
        peak, t0 = 0, time.perf_counter()
        while eng.step():
            peak = max(peak, sum(s is not None and s.req.token_ids != [] for s in eng.scheduler.rows))
        seconds = time.perf_counter() - t0
        out["paged" if paged else "fixed"] = (peak, sum(len(r.token_ids) for r in reqs) / seconds,
                                              eng.stats.preempted)
    return out


def decode_rate(ctx, concurrent: int, paged: bool, text: list[int], new_tokens: int) -> float:
    from shardwise.worker.serving.request import Request
    eng = engine(ctx, concurrent, paged)
    reqs = [Request(text[i * 5:i * 5 + 32], max_new_tokens=new_tokens) for i in range(concurrent)]
    for r in reqs:
        eng.submit(r)
    while any(r.first_token_at is None for r in reqs):
        eng.step()
    done = sum(len(r.token_ids) for r in reqs)
    t0 = time.perf_counter()
    while eng.step():
        pass
    return (sum(len(r.token_ids) for r in reqs) - done) / (time.perf_counter() - t0)


def shared_prefix_decode(ctx, system: list[int], concurrent: int, paged: bool, new_tokens: int) -> tuple[float, int]:
    """Decode tokens/s of `concurrent` requests that share `system`, and the cache positions they
    hold at the end of their prefills."""
    from shardwise.worker.serving.request import Request
    eng = engine(ctx, concurrent, paged)
    reqs = [Request(system + [20 + i, 30 + i], max_new_tokens=new_tokens) for i in range(concurrent)]
    for r in reqs:
        eng.submit(r)
    while any(r.first_token_at is None for r in reqs):
        eng.step()
    held = eng.pool.used * eng.block_size if paged else sum(r.length for r in reqs)
    done = sum(len(r.token_ids) for r in reqs)
    t0 = time.perf_counter()
    while eng.step():
        pass
    return (sum(len(r.token_ids) for r in reqs) - done) / (time.perf_counter() - t0), held


def longest_pause(ctx, long_prompt: list[int], chunk: int) -> float:
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    eng = Engine(ctx.stage, 2, ctx.max_seq, [], prefill_chunk=chunk, **step_budget(chunk))
    stream = eng.submit(Request(long_prompt[:8], max_new_tokens=10 ** 6))
    stamps = []
    stream.on_token = lambda r, t: stamps.append(time.perf_counter())
    for _ in range(4):
        eng.step()
    long = eng.submit(Request(long_prompt, max_new_tokens=1))
    while not long.done.is_set():
        eng.step()
    after = len(stamps)
    while len(stamps) < after + 2:            # the stream's first tokens after the prefill
        eng.step()
    stream.cancel()
    while eng.step():
        pass
    return max(b - a for a, b in zip(stamps, stamps[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-seq-len", type=int, default=1280)
    ap.add_argument("--budget-tokens", type=int, default=5120)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arrival-rate", type=float, default=4.0, help="requests/s of scenario 6")
    ap.add_argument("--arrivals", type=int, default=48, help="requests of scenario 6")
    ap.add_argument("--only-arrivals", action="store_true", help="run scenario 6 alone")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="scenario 6's --max-step-tokens (default: the engine's)")
    args = ap.parse_args()

    from shardwise.worker.serving.request import Request
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec, validate
    from shardwise.worker.weights.tokenizer import load_tokenizer
    spec = RankSpec(args.model, max_batch=32, max_seq=args.max_seq_len)
    tokenizer = load_tokenizer(validate(spec))
    with open(os.path.join(HERE, "data", "river.txt")) as f:
        river = tokenizer.encode(f.read())
    text = (river * (-(-(args.max_seq_len * 2) // len(river))))
    system = text[:args.system_tokens]
    print(f"model {args.model}, one rank, {os.cpu_count()} cores; context {args.max_seq_len} tokens")
    with LocalRuntime(spec) as ctx:
        run(engine(ctx, 1, True), [Request(text[:16], max_new_tokens=4)])      # warm-up
        if args.only_arrivals:
            print_arrivals(ctx, text, args.arrival_rate, args.arrivals, args.step_tokens)
            return 0
        cold, warm = time_to_first_token(ctx, system, args.rounds)
        print(f"\n1. time to first token, {len(system)}-token system prompt:  cold {cold * 1e3:.0f} ms   "
              f"cached {warm * 1e3:.0f} ms   {cold / warm:.1f}x faster")

        mix = largest_batch(ctx, args.budget_tokens, text, 32)
        (fp, ft, _), (pp, pt, pre) = mix["fixed"], mix["paged"]
        print(f"\n2. {args.budget_tokens}-token cache, 24 short ({48}+32) and 4 long "
              f"({args.max_seq_len * 3 // 4}+32) requests:")
        print(f"   fixed rows: {fp} decoding together, {ft:.1f} tok/s")
        print(f"   paged:      {pp} decoding together, {pt:.1f} tok/s ({pre} preemptions)   "
              f"{pp / fp:.1f}x the batch, {pt / ft:.2f}x the tokens/s")

        print(f"\n3. decode tokens/s ({args.new_tokens} new tokens per request, 32-token prompts):")
        print("   concurrent   fixed rows    paged    paged / fixed")
        for n in (1, 8, 32):
            rates = {False: [], True: []}
            for _ in range(args.rounds):          # alternating, so that drift hits both alike
                for paged in (False, True):
                    rates[paged].append(decode_rate(ctx, n, paged, text, args.new_tokens))
            fixed, paged = max(rates[False]), max(rates[True])
            print(f"   {n:>10}   {fixed:>10.1f}   {paged:>6.1f}    {paged / fixed:.2f}")

        print(f"\n4. {8} requests sharing the {len(system)}-token system prompt, decode tokens/s:")
        fixed, fixed_held = shared_prefix_decode(ctx, system, 8, False, args.new_tokens)
        paged, paged_held = shared_prefix_decode(ctx, system, 8, True, args.new_tokens)
        print(f"   fixed rows: {fixed:.1f} tok/s, {fixed_held} positions cached   paged: {paged:.1f} tok/s, "
              f"{paged_held} positions cached   paged / fixed: {paged / fixed:.2f} tok/s, "
              f"{paged_held / fixed_held:.2f} of the memory")

        long_prompt = text[:args.max_seq_len - 64]
        whole = longest_pause(ctx, long_prompt, args.max_seq_len)
        chunked = longest_pause(ctx, long_prompt, args.prefill_chunk)
        print(f"\n5. longest pause of a running stream while a {len(long_prompt)}-token prompt is prefilled: "
              f"whole {whole * 1e3:.0f} ms   chunks of {args.prefill_chunk}: {chunked * 1e3:.0f} ms   "
              f"{whole / chunked:.1f}x shorter")
        print_arrivals(ctx, text, args.arrival_rate, args.arrivals, args.step_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
