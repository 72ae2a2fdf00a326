"""Mixture-of-experts serving under expert parallel degrees, in one run.

    python benchmarks/moe_bench.py [--eps 1,2,4] [--new-tokens 32] [--prompt-tokens 64] [--rounds 3]

A random-weight Mixtral-shaped model (8 experts, top-2; written once under
~/.cache/shardwise/bench) runs at each expert-parallel degree (EP = TP: the experts split across
the tensor group, worker/model/moe.py). Per degree it prints prefill and batch-1 decode tokens/s (best
of --rounds), the expert weight bytes rank 0 holds, the bytes rank 0's collectives moved per
decoded token (the one all-reduce per attention and per MoE layer), and the expert imbalance
(max/mean tokens per expert, per layer) over the fixed text benchmarks/data/river.txt, fed as
byte ids. EP 1 is the baseline of the ratios. On a machine with fewer cores than ranks the ranks
share cores, which the figures then show rather than hide.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPE = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=1024)
HERE = os.path.dirname(os.path.abspath(__file__))


def model_dir(cache: str) -> str:
    path = os.path.join(cache, "random-mixtral-8e-v1")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
        torch.manual_seed(0)
        MixtralForCausalLM(MixtralConfig(**SHAPE)).save_pretrained(path + ".part")
        os.replace(path + ".part", path)
    return path


def measure(path: str, ep: int, prompt: list[int], text: list[int], new_tokens: int, rounds: int) -> dict:
    from shardwise.worker.distributed import tensor_parallel as parallel
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    from shardwise.worker.model.moe import expert_load, imbalance
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec
    spec = RankSpec(path, ep, 1, max_batch=1, max_seq=max(len(prompt) + new_tokens, len(text)) + 8)
    with LocalRuntime(spec) as ctx:
        engine = Engine(ctx.stage, 1, ctx.max_seq, [])
        engine.generate([Request(prompt, max_new_tokens=4)])          # warm-up
        prefill = decode = float("inf")
        comm_per_token = 0.0
        for _ in range(rounds):
            req = Request(prompt, max_new_tokens=new_tokens)
            t0 = time.perf_counter()
            engine.generate([req])
            prefill = min(prefill, req.first_token_at - t0)
            decode = min(decode, (req.finished_at - req.first_token_at) / (len(req.token_ids) - 1))
        before = parallel.COMM.bytes
        req = Request(prompt[:1], max_new_tokens=new_tokens + 1)       # one prompt token: almost all decode
        engine.generate([req])
        comm_per_token = (parallel.COMM.bytes - before) / len(req.token_ids)
        model = ctx.stage.model
        for layer in model.layers.values():                             # the text's load alone
            layer.feed_forward.tokens_per_expert = None
        engine.generate([Request(text, max_new_tokens=1)])
        load = expert_load(model)
        ffn = model.layers["0"].feed_forward
        expert_bytes = sum(sum(p.numel() * p.element_size() for p in (l.feed_forward.w1, l.feed_forward.w2,
                                                                       l.feed_forward.w3))
                           for l in model.layers.values())
        return {"prefill_tps": len(prompt) / prefill, "decode_tps": 1 / decode,
                "expert_bytes_rank0": expert_bytes, "experts_rank0": ffn.w1.shape[0],
                "comm_bytes_per_token": comm_per_token,
                "imbalance_by_layer": {k: round(imbalance(v), 3) for k, v in load.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eps", default="1,2,4")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/shardwise/bench"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch
    path = model_dir(args.cache)
    with open(os.path.join(HERE, "data", "river.txt"), "rb") as f:
        text = list(f.read())[:960]             # byte ids (the vocabulary has 512), within the context
    prompt = text[:args.prompt_tokens]
    print(f"random Mixtral-shaped model: {SHAPE['num_hidden_layers']} layers, {SHAPE['num_local_experts']} experts "
          f"top-{SHAPE['num_experts_per_tok']}, hidden {SHAPE['hidden_size']}; torch {torch.__version__}, "
          f"{os.cpu_count()} cores; text {len(text)} tokens", flush=True)
    results = {}
    for ep in (int(e) for e in args.eps.split(",")):
        results[ep] = r = measure(path, ep, prompt, text, args.new_tokens, args.rounds)
        base = results[min(results)]
        print(f"EP {ep}: prefill {r['prefill_tps']:.0f} tok/s ({r['prefill_tps'] / base['prefill_tps']:.2f}x), "
              f"decode {r['decode_tps']:.1f} tok/s ({r['decode_tps'] / base['decode_tps']:.2f}x); rank 0 holds "
              f"{r['experts_rank0']} experts a layer, {r['expert_bytes_rank0'] / 2**20:.1f} MiB "
              f"({r['expert_bytes_rank0'] / base['expert_bytes_rank0']:.2f}x); "
              f"all-reduce {r['comm_bytes_per_token'] / 1024:.1f} KiB per decoded token", flush=True)
        print(f"      imbalance (max/mean) by layer: {r['imbalance_by_layer']}", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
