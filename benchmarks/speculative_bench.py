"""Speculative decoding (prompt lookup) against plain decoding on repetitive-text work, in one run.

    python benchmarks/speculative_bench.py [--model smollm2] [--quantize none] [--rounds 3]
        [--concurrent 1] [--new-tokens 160] [--draft-tokens 4] [--ngram 2:3] [--threads 0] [--json]

Both sides run on the same loaded model (one rank) through the same engine, the only difference
being `speculative` (worker/serving/speculative.py), in alternating rounds so that both see the
same load on a shared machine; each side's best round counts. The workload is what prompt lookup
is for, chat prompts whose answer repeats the prompt:

  code-edit   a Python function and "rename a variable, output the whole function"
  summary     benchmarks/data/river.txt and "summarise it, quoting its key sentences"
  fix-text    the same document with typos and "repeat it with the typos fixed"

Each request is greedy; `--concurrent` copies of each workload's request decode together. Decode
tokens/s counts the tokens after each request's first, over the time from the last first token to
the end (prefill excluded; it is the same on both sides). Prints each workload's tokens/s on both
sides, the ratio, the acceptance rate (accepted drafts over drafts fed) and whether the texts are
identical (they must be: greedy verification), then the overall ratio; `--json` adds them as one
JSON line (for benchmarks/ab.py --json-key).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def running_max(values):
    """The largest value seen so far, at each position."""
    result = []
    best = None
    for x in values:
        if best is None or x > best:
            best = x
        result.append(best)
    return result
'''

TYPOS = (("river", "rivre"), ("bridge", "brigde"), ("summer", "sumer"), ("farmers", "famers"), ("paper", "papper"))


def workloads() -> dict[str, str]:
    with open(os.path.join(HERE, "data", "river.txt")) as f:
        river = f.read().strip()
    typos = river
    for right, wrong in TYPOS:
        typos = typos.replace(right, wrong, 1)
    return {
        "code-edit": f"Rename the variable `x` to `value` in this code. Output the whole code.\n\n{CODE}",
        "summary": f"{river}\n\nSummarise the text above in a few sentences, quoting its key sentences.",
        "fix-text": f"Fix the spelling mistakes in this text and repeat the whole text:\n\n{typos}",
    }


def decode(ctx, prompt: list[int], eos: list[int], concurrent: int, new_tokens: int, speculative):
    """(decode tokens/s, each request's tokens, the engine's speculative stats or None)."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    eng = Engine(ctx.stage, concurrent, ctx.max_seq, eos, speculative=speculative)
    reqs = [Request(list(prompt), max_new_tokens=new_tokens) for _ in range(concurrent)]
    for r in reqs:
        eng.submit(r)
    while any(r.first_token_at is None for r in reqs):
        eng.step()
    first = sum(len(r.token_ids) for r in reqs)
    t0 = time.perf_counter()
    while eng.step():
        pass
    seconds = time.perf_counter() - t0
    rate = (sum(len(r.token_ids) for r in reqs) - first) / seconds
    return rate, [r.token_ids for r in reqs], eng.speculator.stats if eng.speculator else None


def main() -> int:
    from shardwise.crds.speculative import DRAFT_TOKENS, NGRAM_MAX, NGRAM_MIN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantize", default="none", choices=["none", "int8", "gguf"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--draft-tokens", type=int, default=DRAFT_TOKENS)
    ap.add_argument("--ngram", default=f"{NGRAM_MIN}:{NGRAM_MAX}", metavar="MIN:MAX")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from shardwise.worker.serving.rank import LocalRuntime, RankSpec, validate
    from shardwise.worker.serving.speculative import SpeculativeConfig
    from shardwise.worker.weights.tokenizer import load_tokenizer
    low, high = (int(v) for v in args.ngram.split(":"))
    config = SpeculativeConfig(args.draft_tokens, low, high)
    spec = RankSpec(args.model, max_batch=args.concurrent, max_seq=args.max_seq_len, quantize=args.quantize,
                    threads=args.threads)
    tokenizer = load_tokenizer(validate(spec))
    prompts = {name: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
               for name, text in workloads().items()}
    results, base_total, spec_total, tokens_total = {}, 0.0, 0.0, 0
    with LocalRuntime(spec) as ctx:
        for name, prompt in prompts.items():
            best = {None: 0.0, config: 0.0}
            texts, stats = {}, None
            for _ in range(args.rounds):
                for side in (None, config):          # alternating: both see the same drift
                    rate, tokens, side_stats = decode(ctx, prompt, tokenizer.eos_ids, args.concurrent,
                                                      args.new_tokens, side)
                    best[side] = max(best[side], rate)
                    texts[side] = tokens
                    stats = side_stats or stats
            generated = sum(len(t) - 1 for t in texts[None])
            results[name] = {"prompt_tokens": len(prompt), "decode_tokens": generated,
                             "base_tps": round(best[None], 2), "speculative_tps": round(best[config], 2),
                             "ratio": round(best[config] / best[None], 3),
                             "acceptance": round(stats.acceptance, 3), "identical": texts[None] == texts[config]}
            base_total += generated / best[None]
            spec_total += generated / best[config]
            tokens_total += generated
            r = results[name]
            print(f"{name:10s} prompt {r['prompt_tokens']:4d} tokens, decode {generated:4d}: plain "
                  f"{r['base_tps']:7.2f} tok/s, speculative {r['speculative_tps']:7.2f} tok/s, ratio "
                  f"{r['ratio']:.2f}x, acceptance {r['acceptance']:.2f}, identical {r['identical']}", flush=True)
    overall = {"ratio": round(base_total / spec_total, 3), "decode_tokens": tokens_total,
               "identical": all(r["identical"] for r in results.values())}
    print(f"overall decode tokens/s ratio {overall['ratio']:.2f}x (speculative / plain, "
          f"{args.concurrent} concurrent, k={args.draft_tokens}, n={args.ngram}), identical {overall['identical']}")
    if args.json:
        print(json.dumps({"workloads": results, "overall": overall}))
    return 0 if overall["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
