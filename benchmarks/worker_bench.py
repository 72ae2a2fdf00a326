"""Worker inference speed against Hugging Face transformers on the same model and machine.

    python benchmarks/worker_bench.py [--model smollm2] [--prompt-tokens 128] [--new-tokens 64]
                                      [--layouts 1x1,1x1c,1x2] [--device cpu] [--dtype float32] [--json]

A layout is TPxPP; a trailing "c" (1x1c) runs the same layout with `--decode compile`, the
opt-in compiled decode step on CPU (measured for single-process layouts).

Threads: each of our ranks gets the machine's cores divided among the ranks (as the worker runs by
default), transformers and the bandwidth measurement get all of them; --threads N gives N to each.

Measured in one run: the machine's memory read bandwidth (reading a 512 MiB matrix); for each TP x PP
layout, transformers' `generate` and ours in alternating rounds (best of each, so both see the same
load on a shared machine): prefill tokens/s, decode
tokens/s, the fraction of the memory-bandwidth bound the decode reaches (every decode step reads
each rank's weights once: bound = read bandwidth / weight bytes), weight bytes and peak memory per
rank, communication seconds per rank, and for PP > 1 the throughput of 4 concurrent requests with
one micro-batch vs one micro-batch per stage in flight.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n for the block, then put back."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Bandwidth:
    """The memory bandwidth `threads` threads get reading (what a decode step does with the weights):
    a 512 MiB matrix read once by a sum and once by a matrix-vector product (the kernel a decode
    step runs; on the development machine it streams faster than a sum), the best kept. On CPU
    the matrix sits in 2 MiB pages where the OS gives them, as the worker's weights do.
    Measured again in every round, since other processes on a shared machine take bandwidth in
    bursts."""

    def __init__(self, device: str, threads: int, mib: int = 512):
        import torch

        from shardwise.worker.distributed.placement import huge_page_buffer
        self.device, self.threads = device, threads
        n = mib * 2**20 // 4
        buf = huge_page_buffer(n * 4) if device == "cpu" else None
        self.src = buf.view(torch.float32) if buf is not None else torch.empty(n, device=device)
        self.src.fill_(1.0)
        self.matrix = self.src.view(8192, -1)
        self.vector = torch.ones(1, 8192, device=device)
        self.dst = torch.zeros_like(self.src)      # touched once here, so copies do not page-fault
        self.best = 0.0
        self.copy_best = 0.0

    def sample(self, repeats: int = 3) -> float:
        import torch
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        n = self.src.numel() * 4
        with torch_threads(self.threads):       # the in-process rank may have set fewer
            for _ in range(repeats):
                for read in (self.src.sum, lambda: self.vector @ self.matrix):
                    sync()
                    t0 = time.perf_counter()
                    read()
                    sync()
                    self.best = max(self.best, n / (time.perf_counter() - t0))
            sync()
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            sync()
            self.copy_best = max(self.copy_best, 2 * n / (time.perf_counter() - t0))
        return self.best


class HFRunner:
    """transformers' generate on the same weights; prefill = time of a 1-token generate. It runs
    with `threads` torch threads whatever our in-process rank set."""

    def __init__(self, model: str, prompt: list[int], dtype, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        from shardwise.worker.weights.loader import resolve_model
        path = resolve_model(model)
        if path.endswith(".gguf"):
            self.hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                           gguf_file=os.path.basename(path), dtype=dtype)
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.hf.eval()
        self.threads = threads
        self.ids = torch.tensor([prompt])
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.hf.parameters())
        self.run(2)

    def run(self, n: int) -> float:
        import torch
        with torch_threads(self.threads), torch.no_grad():
            t0 = time.perf_counter()
            self.hf.generate(self.ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
            return time.perf_counter() - t0


def compare(model: str, layouts: list[tuple[int, int, bool]], prompt: list[int], new_tokens: int, device: str,
            dtype: str, rounds: int, threads: int, bandwidth: "Bandwidth", with_hf: bool, concurrent: int = 4) -> dict:
    """Ours per layout, with transformers measured in the same rounds (alternating, best of each),
    so both see the same load on a shared machine."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    from shardwise.worker.weights.loader import DTYPES
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec
    hf = HFRunner(model, prompt, DTYPES[dtype], bandwidth.threads) if with_hf else None
    results = {}
    for tp, pp, compiled in layouts:
        print(f"  TP={tp} PP={pp}{' compiled decode' if compiled else ''} ...", flush=True)
        spec = RankSpec(model, tp, pp, device=device, dtype=dtype, max_batch=max(1, concurrent),
                        max_seq=len(prompt) + new_tokens + 8, threads=threads,
                        decode="compile" if compiled else "auto")
        rt = LocalRuntime(spec)
        ctx = rt.start()
        best = {"prefill": float("inf"), "decode": float("inf"), "hf_prefill": float("inf"),
                "hf_decode": float("inf")}
        try:
            engine = Engine(ctx.stage, 1, ctx.max_seq, [])
            t0 = time.perf_counter()
            engine.generate([Request(prompt, max_new_tokens=4)])          # warm-up (and compile)
            if compiled:
                print(f"    warm-up with compilation: {time.perf_counter() - t0:.1f} s", flush=True)
            for _ in range(rounds):
                bandwidth.sample()
                req = Request(prompt, max_new_tokens=new_tokens)
                t0 = time.perf_counter()
                engine.generate([req])
                best["prefill"] = min(best["prefill"], req.first_token_at - t0)
                best["decode"] = min(best["decode"], (req.finished_at - req.first_token_at) / (new_tokens - 1))
                if hf is not None:
                    t1, tn = hf.run(1), hf.run(new_tokens)
                    best["hf_prefill"] = min(best["hf_prefill"], t1)
                    best["hf_decode"] = min(best["hf_decode"], (tn - t1) / (new_tokens - 1))
            if pp > 1 and concurrent > 1:
                # Several requests in flight: one micro-batch at a time vs one per stage.
                for mbs in (1, pp):
                    engine = Engine(ctx.stage, concurrent, ctx.max_seq, [], micro_batches=mbs)
                    reqs = [Request(prompt[:16], max_new_tokens=new_tokens) for _ in range(concurrent)]
                    t0 = time.perf_counter()
                    engine.generate(reqs)
                    best[f"batch_tps_mb{mbs}"] = concurrent * new_tokens / (time.perf_counter() - t0)
            loaded = ctx.loaded
        finally:
            final = rt.stop()
        r = {"prefill_tps": len(prompt) / best["prefill"], "decode_tps": 1 / best["decode"],
             "weight_bytes": [x["weight_bytes"] for x in loaded],
             "peak_rss_bytes": [x["peak_rss_bytes"] for x in final or []],
             "comm_seconds": [round(x["comm_seconds"], 3) for x in final or []]}
        # One decode step reads every rank's weights once; the ranks share the machine's bandwidth.
        r["bound_fraction"] = r["decode_tps"] * sum(r["weight_bytes"]) / bandwidth.best
        r["read_bandwidth_gbs"] = bandwidth.best / 1e9
        if hf is not None:
            r["hf_prefill_tps"] = len(prompt) / best["hf_prefill"]
            r["hf_decode_tps"] = 1 / best["hf_decode"]
            r["hf_bound_fraction"] = r["hf_decode_tps"] * hf.weight_bytes / bandwidth.best
            r["decode_vs_hf"] = r["decode_tps"] / r["hf_decode_tps"]
            r["prefill_vs_hf"] = r["prefill_tps"] / r["hf_prefill_tps"]
            print(f"    transformers: prefill {r['hf_prefill_tps']:.0f} tok/s, decode {r['hf_decode_tps']:.2f} "
                  f"tok/s, {100 * r['hf_bound_fraction']:.0f}% of bandwidth bound", flush=True)
        vs = (f"; {r['decode_vs_hf']:.2f}x transformers decode, {r['prefill_vs_hf']:.2f}x prefill"
              if hf is not None else "")
        print(f"    shardwise:    prefill {r['prefill_tps']:.0f} tok/s, decode {r['decode_tps']:.2f} tok/s, "
              f"{100 * r['bound_fraction']:.0f}% of bandwidth bound{vs}", flush=True)
        print("    weight MiB per rank: " + ", ".join(f"{b / 2**20:.0f}" for b in r["weight_bytes"])
              + "; peak RSS MiB per rank: " + ", ".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes"])
              + "; communication s per rank: " + ", ".join(map(str, r["comm_seconds"])), flush=True)
        if "batch_tps_mb1" in best:
            r["concurrent_requests"] = concurrent
            r["batch_tps_one_microbatch"] = best["batch_tps_mb1"]
            r["batch_tps_microbatch_per_stage"] = best[f"batch_tps_mb{pp}"]
            print(f"    {concurrent} concurrent requests: {best['batch_tps_mb1']:.1f} tok/s with one micro-batch, "
                  f"{best[f'batch_tps_mb{pp}']:.1f} tok/s with {pp} in flight (one per stage)", flush=True)
        results[f"{tp}x{pp}{'c' if compiled else ''}"] = r
    return results


def random_llama(path: str) -> str:
    """A SmolLM2-sized random Llama whose 8 heads / 4 kv heads split for TP=2 (SmolLM2's 9/3 do not)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.weights.tokenizer import load_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="200MB")
    load_tokenizer(open_model("smollm2")).tok.save(os.path.join(path, "tokenizer.json"))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model for --layouts (default smollm2)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layouts", default="1x1,1x1c,1x2",
                    help="comma-separated TPxPP for --model; a trailing c: compiled decode (1x1 only)")
    ap.add_argument("--tp2-layouts", default="1x1,2x1,1x2",
                    help="layouts for a SmolLM2-sized random Llama with 8 heads (TP=2 works); '' to skip")
    ap.add_argument("--random-dir", default=os.path.expanduser("~/.cache/shardwise/bench/random-llama-8h"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; best of each side")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for transformers, the bandwidth measurement and each of our ranks "
                         "(default 0: as the worker runs, each rank gets cores / ranks; transformers and the "
                         "bandwidth measurement get all cores)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = ap.parse_args(argv)

    import torch

    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.weights.tokenizer import load_tokenizer
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    source = open_model(args.model)
    tok = load_tokenizer(source)
    words = ("The history of the printing press begins in the fifteenth century, when movable type "
             "changed how knowledge spread across Europe and the world. ") * 40
    prompt = tok.encode(words)[:args.prompt_tokens]
    out = {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "prompt_tokens": len(prompt), "new_tokens": args.new_tokens}

    print(f"model {args.model}: {source.config.num_layers} layers, {source.config.num_params / 1e6:.0f}M params; "
          f"{args.device} {args.dtype}, {os.cpu_count()} cpus; prompt {len(prompt)} tokens, "
          f"{args.new_tokens} new", flush=True)

    def parse_layouts(text):
        out = []
        for item in text.lower().split(","):
            if not item:
                continue
            compiled = item.endswith("c")
            tp, pp = (int(x) for x in item.rstrip("c").split("x"))
            if compiled and tp * pp != 1:
                ap.error(f"layout {item}: compiled decode is measured for 1x1 only")
            out.append((tp, pp, compiled))
        return out
    suites = [(args.model, parse_layouts(args.layouts))]
    if args.tp2_layouts:
        suites.append((random_llama(args.random_dir), parse_layouts(args.tp2_layouts)))
    bw = Bandwidth(args.device, threads)
    bw.sample(6)
    print(f"memory bandwidth, {threads} thread(s): read {bw.best / 1e9:.1f} GB/s, "
          f"copy {bw.copy_best / 1e9:.1f} GB/s (read + write); sampled again every round, best kept", flush=True)

    out["models"] = {}
    for model, layouts in suites:
        print(f"{model}:", flush=True)
        out["models"][model] = compare(model, layouts, prompt, args.new_tokens, args.device, args.dtype,
                                       args.rounds, args.threads, bw, not args.skip_hf)
    # Summary with the best bandwidth seen over the whole run.
    print(f"\nsummary (bound = read bandwidth {bw.best / 1e9:.1f} GB/s / weight bytes per decode step):")
    print(f"{'model':<14} {'TPxPP':<6} {'decode tok/s':>12} {'HF decode':>10} {'vs HF':>6} {'prefill tok/s':>13} "
          f"{'HF prefill':>10} {'% bound':>8} {'HF % bound':>10}")
    for model, per_layout in out["models"].items():
        for layout, r in per_layout.items():
            r["bound_fraction"] = r["decode_tps"] * sum(r["weight_bytes"]) / bw.best
            if "hf_decode_tps" in r:
                r["hf_bound_fraction"] = r["hf_bound_fraction"] * r["read_bandwidth_gbs"] * 1e9 / bw.best
            name = os.path.basename(model.rstrip("/"))[:14]
            hf = (f"{r['hf_decode_tps']:>10.2f} {r['decode_vs_hf']:>5.2f}x {r['prefill_tps']:>13.0f} "
                  f"{r['hf_prefill_tps']:>10.0f} {100 * r['bound_fraction']:>7.0f}% {100 * r['hf_bound_fraction']:>9.0f}%"
                  if "hf_decode_tps" in r else f"{'-':>10} {'-':>6} {r['prefill_tps']:>13.0f} {'-':>10} "
                  f"{100 * r['bound_fraction']:>7.0f}% {'-':>10}")
            print(f"{name:<14} {layout:<6} {r['decode_tps']:>12.2f} {hf}")
    out["read_bandwidth_gbs"] = bw.best / 1e9
    out["copy_bandwidth_gbs"] = bw.copy_best / 1e9
    print(f"memory bandwidth at the end, best of all rounds: read {bw.best / 1e9:.1f} GB/s, "
          f"copy {bw.copy_best / 1e9:.1f} GB/s. Fractions above use the best read figure seen when "
          f"they were printed.", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
