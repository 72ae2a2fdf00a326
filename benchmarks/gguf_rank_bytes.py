"""What each rank of a `--quantize gguf` launch holds, under tensor x pipeline parallelism.

    python benchmarks/gguf_rank_bytes.py [--model smollm2] [--tensor 2] [--pipeline 1]
                                         [--new-tokens 0] [--threads 0] [--json]

Starts the ranks as `shardwise serve` does on one machine (serving/rank.py LocalRuntime: real
processes over gloo), and prints each rank's weight bytes (tensor_parallel.weight_bytes: every
parameter it holds, a tied one once) and the largest. With --new-tokens N it also decodes N tokens
of one prompt (greedy, batch 1, best of 2 after a warm-up) and prints the tokens a second.

To compare two revisions, run it through benchmarks/ab.py with `--json-key max_rank_bytes`.
"""
from __future__ import annotations

import argparse
import json
import sys

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(model: str, tensor: int, pipeline: int, new_tokens: int, threads: int) -> dict:
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec
    from shardwise.worker.serving.request import Request
    from shardwise.worker.weights.loader import open_model, resolve_model
    from shardwise.worker.weights.tokenizer import load_tokenizer
    path = resolve_model(model)
    prompt = load_tokenizer(open_model(path)).encode(PROMPT)
    spec = RankSpec(path, tensor, pipeline, max_batch=1, max_seq=len(prompt) + new_tokens + 8,
                    quantize="gguf", threads=threads)
    with LocalRuntime(spec) as ctx:
        ranks = [{"rank": r["rank"], "stage": r["stage"], "tp_rank": r["tp_rank"],
                  "weight_bytes": r["weight_bytes"]} for r in ctx.loaded]
        out = {"model": path, "tensor": tensor, "pipeline": pipeline, "ranks": ranks,
               "max_rank_bytes": max(r["weight_bytes"] for r in ranks)}
        if new_tokens:
            engine = Engine(ctx.stage, 1, ctx.max_seq, [])
            engine.generate([Request(prompt, max_new_tokens=4)])          # warm-up
            best = float("inf")
            for _ in range(2):
                req = Request(prompt, max_new_tokens=new_tokens)
                engine.generate([req])
                best = min(best, (req.finished_at - req.first_token_at) / (len(req.token_ids) - 1))
            out["decode_tps"] = 1 / best
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF model: a path or a built-in name")
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--pipeline", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=0, help="also decode this many tokens (0: bytes only)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = measure(args.model, args.tensor, args.pipeline, args.new_tokens, args.threads)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} TP {args.tensor} x PP {args.pipeline}, --quantize gguf")
    for r in out["ranks"]:
        print(f"  rank {r['rank']} (stage {r['stage']}, tp rank {r['tp_rank']}): {r['weight_bytes'] / 2**20:.1f} MiB")
    if "decode_tps" in out:
        print(f"  decode {out['decode_tps']:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
