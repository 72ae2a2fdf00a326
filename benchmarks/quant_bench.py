"""Weight formats side by side: bytes, decode and prefill speed, and perplexity, in one run.

    python benchmarks/quant_bench.py [--model smollm2] [--new-tokens 48] [--rounds 3] [--json]
                                     [--formats fp32,int8,"gguf (file)"] [--skip-perplexity]

For one GGUF model (default: the built-in SmolLM2, a Q4_1 file) this makes its Q8_0 and Q4_0
variants (worker/weights/gguf_index.py write_requantized, cached under ~/.cache/shardwise/bench) and runs
one rank (TP 1, PP 1) in each format:

  fp32        the file dequantized to float32 (the reference: perplexity ratios are against it)
  bf16        dequantized to bfloat16
  int8        dequantized, then `--quantize int8` (float32 activations)
  bf16+int8   the same with bfloat16 activations
  gguf Q4_1   `--quantize gguf`: the file's blocks kept (the model as shipped)
  gguf Q8_0   the Q8_0 variant's blocks kept     (its perplexity: against its own dequantized fp32)
  gguf Q4_0   the Q4_0 variant's blocks kept     (likewise)

and prints, per format: the rank's weight bytes (and the ratio to fp32), decode tokens/s at batch 1
(best of --rounds; the formats alternate within each round, so all see the same load on a shared
machine) with the ratio to fp32, prefill tokens/s, and perplexity on a fixed text.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

TEXT = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "river.txt")).read()   # as the tests
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def formats(model: str, cache: str) -> dict[str, tuple[str, str, str]]:
    """name -> (model path, dtype, --quantize)."""
    from shardwise.worker.weights.gguf_index import write_requantized
    from shardwise.worker.weights.loader import resolve_model
    path = resolve_model(model)
    variants = {}
    for qtype in ("Q8_0", "Q4_0"):
        out = os.path.join(cache, f"{os.path.basename(path)[:-5]}.{qtype}.gguf")
        if not os.path.exists(out):
            os.makedirs(cache, exist_ok=True)
            print(f"writing {out} ...", flush=True)
            write_requantized(path, out + ".part", qtype)
            os.replace(out + ".part", out)
        variants[qtype] = out
    return {"fp32": (path, "float32", "none"), "bf16": (path, "bfloat16", "none"),
            "int8": (path, "float32", "int8"), "bf16+int8": (path, "bfloat16", "int8"),
            "gguf (file)": (path, "float32", "gguf"),
            "gguf Q8_0": (variants["Q8_0"], "float32", "gguf"), "gguf Q4_0": (variants["Q4_0"], "float32", "gguf"),
            "Q8_0 as fp32": (variants["Q8_0"], "float32", "none"), "Q4_0 as fp32": (variants["Q4_0"], "float32", "none")}


def measure(path: str, dtype: str, quantize: str, prompt: list[int], text: list[int], new_tokens: int,
            threads: int, with_ppl: bool) -> dict:
    """One runtime: weight bytes, best-of-2 decode seconds a token and prefill seconds, perplexity."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec, teacher_forced_nll
    spec = RankSpec(path, 1, 1, dtype=dtype, max_batch=1, quantize=quantize, threads=threads,
                    max_seq=max(len(text), len(prompt) + new_tokens) + 8)
    with LocalRuntime(spec) as ctx:
        engine = Engine(ctx.stage, 1, ctx.max_seq, [])
        engine.generate([Request(prompt, max_new_tokens=4)])      # warm-up
        decode = prefill = float("inf")
        for _ in range(2):
            req = Request(prompt, max_new_tokens=new_tokens)
            t0 = time.perf_counter()
            engine.generate([req])
            prefill = min(prefill, req.first_token_at - t0)
            decode = min(decode, (req.finished_at - req.first_token_at) / (len(req.token_ids) - 1))
        ppl = math.exp(teacher_forced_nll(ctx, text)) if with_ppl else None
        return {"weight_bytes": ctx.loaded[0]["weight_bytes"], "decode_s": decode, "prefill_s": prefill,
                "perplexity": ppl}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF model: a path or a built-in name")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/shardwise/bench"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--formats", default="", help="comma-separated names of the table below (default: all); "
                                                  "fp32 is always run (the reference)")
    ap.add_argument("--skip-perplexity", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.weights.tokenizer import load_tokenizer
    tok = load_tokenizer(open_model(args.model))
    prompt, text = tok.encode(PROMPT), tok.encode(TEXT)
    fmts = formats(args.model, args.cache)
    if args.formats:
        wanted = {"fp32", *(f.strip() for f in args.formats.split(","))}
        fmts = {name: f for name, f in fmts.items() if name in wanted}
    print(f"{args.model}: {len(prompt)}-token prompt, {args.new_tokens} new tokens, perplexity over "
          f"{len(text)} tokens; torch {torch.__version__}, {os.cpu_count()} cores", flush=True)
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for name, (path, dtype, quantize) in fmts.items():
            got = measure(path, dtype, quantize, prompt, text, args.new_tokens, args.threads, with_ppl=r == 0 and not args.skip_perplexity)
            b = best.setdefault(name, got)
            for key in ("decode_s", "prefill_s"):
                b[key] = min(b[key], got[key])
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    ref = best["fp32"]
    own_ref = {"gguf Q8_0": "Q8_0 as fp32", "gguf Q4_0": "Q4_0 as fp32"}
    own_ref = {k: v for k, v in own_ref.items() if v in best}
    print(f"\n{'format':14} {'weight MiB':>10} {'x fp32':>7} {'decode tok/s':>13} {'x fp32':>7} "
          f"{'prefill tok/s':>14} {'perplexity':>11} {'x ref':>7}")
    rows = {}
    for name, b in best.items():
        base = best[own_ref.get(name, "fp32" if not name.endswith("as fp32") else name)]
        row = {"weight_bytes": b["weight_bytes"], "bytes_vs_fp32": b["weight_bytes"] / ref["weight_bytes"],
               "decode_tps": 1 / b["decode_s"], "decode_vs_fp32": ref["decode_s"] / b["decode_s"],
               "prefill_tps": len(prompt) / b["prefill_s"], "perplexity": b["perplexity"],
               "perplexity_vs_ref": b["perplexity"] / base["perplexity"] if b["perplexity"] else None}
        rows[name] = row
        print(f"{name:14} {row['weight_bytes'] / 2**20:10.1f} {row['bytes_vs_fp32']:7.2f} {row['decode_tps']:13.1f} "
              f"{row['decode_vs_fp32']:7.2f} {row['prefill_tps']:14.0f} {row['perplexity'] or 0:11.4f} "
              f"{row['perplexity_vs_ref'] or 0:7.4f}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
