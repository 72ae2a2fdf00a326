"""The worker on a GPU: bf16 parity with transformers, batch-1 decode against the memory-bandwidth
limit, batched decode through the engine, time to first token, and the bf16 training step.

    python benchmarks/gpu_bench.py [--models 1b,8b] [--sections layers,parity,decode,profile,offload,batched,train]
                                   [--new-tokens 256] [--dir /tmp/shardwise-gpu-bench] [--json FILE]

Needs a CUDA device and transformers. Every figure is measured in this run, on this device:
  * ceilings: a device-to-device copy (bytes read + written per second: the bandwidth a decode step
    can use) and a bf16 8192^3 matrix product;
  * models: random-weight Llamas with Llama-3.2-1B's and Llama-3.1-8B's shapes, written once as an
    HF folder in bf16; the worker loads that folder the way `shardwise serve` does, and
    transformers runs the same weights already on the GPU;
  * layers: bf16 error against fp32 after each layer, the worker's against transformers';
  * parity (1B): the worker's greedy tokens against transformers' in bf16 for 32 new tokens, and
    the worker's bf16 logits against transformers' fp32 logits on the same tokens, beside
    transformers' own bf16 error;
  * profile: where a decode step's time goes (one graph replay alone; its kernels);
  * decode: batch-1 tokens/s and bandwidth use, (weight bytes + key/value bytes of the context)
    per token / time per token / copy bandwidth, for the worker's --decode eager, graphs and compile
    (each also with --quantize int8: --modes compile:int8),
    and for transformers' generate with its dynamic cache (eager) and its static cache (which
    generate compiles);
  * offload: decode with half the weights streamed from pinned host memory against the model
    whole: the same tokens, the slowdown, the overlap of copies and compute;
  * batched (1B): tokens/s at 1, 8, 32 and 64 concurrent requests through the engine, and the time
    to first token of a 1,000-token prompt;
  * train (1B): `shardwise train` steps in bf16 on the GPU (tokens/s, model FLOPs utilisation
    against the measured matrix-product rate), and a small model's loss curve in bf16 on the GPU
    against fp32 on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from shardwise.worker.distributed.tensor_parallel import weight_bytes   # bytes of a model's parameters, a tied pair once
from shardwise.worker.model.inference import install_fused_weights
from shardwise.worker.serving.cache_view import cache_view
from shardwise.worker.serving.cuda_graphs import unpack

SHAPES = {
    # Llama-3.2-1B and Llama-3.1-8B (their config.json values), random weights
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_theta=500000.0, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # for trying the script on a machine without a GPU (--models tiny --device cpu)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                 rope_theta=10000.0, max_position_embeddings=4096),
}


def say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ device ceilings

class Timer:
    """Wall time of device work: synchronize, run, synchronize (median of repeats)."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def median(self, fn, repeats: int = 10, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def ceilings(device: str) -> dict:
    timer = Timer(device)
    n = (1 << 30) if device == "cuda" else (1 << 26)       # bytes per buffer
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = timer.median(lambda: dst.copy_(src), repeats=20)
    copy_bw = 2 * n / copy_s                                 # read + written
    del src, dst
    size = 8192 if device == "cuda" else 1024
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    mm_s = timer.median(lambda: a @ b)
    flops = 2 * size ** 3 / mm_s
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    say(f"device {name}: copy {copy_bw / 1e12:.2f} TB/s (read + written), "
        f"{dtype} {size}^3 matmul {flops / 1e12:.0f} TFLOP/s")
    return {"device": name, "copy_bandwidth": copy_bw, "matmul_flops": flops}


# ------------------------------------------------------------------ models

def byte_tokenizer_json() -> str:
    """A byte-level tokenizer (256 tokens, no merges): the benchmark's models are random, and
    `shardwise train` needs some tokenizer for its text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def cast(hf, dtype: torch.dtype):
    """hf.to(dtype), RoPE's inverse frequencies kept in fp32. Module.to casts every floating
    buffer, those too, which transformers' from_pretrained(dtype=...) keeps in fp32: rounded to
    bf16 they move a 128th position's angles by up to ~0.25 rad, and the 'reference' would no
    longer be the model the worker runs."""
    rot = hf.model.rotary_emb
    if not hasattr(hf, "rope_fp32"):
        hf.rope_fp32 = {name: b.float().clone() for name, b in rot.named_buffers()}
    hf.to(dtype)
    for name, b in hf.rope_fp32.items():
        setattr(rot, name, b.to(next(hf.parameters()).device))
    return hf


def make_model(shape: str, folder: str, device: str):
    """transformers' LlamaForCausalLM with random bf16 weights on `device`, also written to
    `folder` (once) for the worker to load."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        hf = cast(LlamaForCausalLM(cfg), torch.bfloat16)
    hf.eval()
    if not os.path.isfile(os.path.join(folder, "config.json")):
        hf.save_pretrained(folder, max_shard_size="5GB")
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write(byte_tokenizer_json())
    params = sum(p.numel() for p in hf.parameters())
    say(f"{shape}: {params / 1e9:.2f}B parameters, random bf16 weights, built and written in "
        f"{time.perf_counter() - t0:.0f} s")
    return hf


def kv_bytes_per_position(shape: str, dtype_bytes: int = 2) -> int:
    s = SHAPES[shape]
    head_dim = s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * dtype_bytes


class Worker:
    """The worker's single-rank runtime on a model folder (what `shardwise serve` starts)."""

    def __init__(self, folder: str, device: str, dtype: str, decode: str, max_batch: int, max_seq: int,
                 quantize: str = "none"):
        from shardwise.worker.serving.rank import LocalRuntime, RankSpec
        self.rt = LocalRuntime(RankSpec(folder, device=device, dtype=dtype, decode=decode, quantize=quantize,
                                        max_batch=max_batch, max_seq=max_seq))
        t0 = time.perf_counter()
        self.ctx = self.rt.start()
        self.load_s = time.perf_counter() - t0
        self.max_seq = max_seq

    def engine(self, max_batch: int):
        from shardwise.worker.serving.engine import Engine
        return Engine(self.ctx.stage, max_batch, self.max_seq, [])

    def stop(self) -> None:
        self.rt.stop()


def teacher_forced_logits(worker: Worker, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The worker's logits for each position from the prompt's last on, feeding `continuation`
    (not its own choices) one token per decode step: [len(continuation) + 1, V], float32."""
    from shardwise.worker.serving.pipeline import OP_SETUP, OP_STEP
    stage = worker.ctx.stage
    stage.launch(OP_SETUP, cache_blocks=1, seq=worker.max_seq)
    slot = torch.tensor([0])
    stage.launch(OP_STEP, torch.tensor([prompt]), torch.arange(len(prompt))[None], slot)
    rows = [stage.collect()[0].cpu()]
    for i, tok in enumerate(continuation):
        stage.launch(OP_STEP, torch.tensor([[tok]]), torch.tensor([[len(prompt) + i]]), slot)
        rows.append(stage.collect()[0].cpu())
    return torch.stack(rows)


# ------------------------------------------------------------------ parity

def parity(shape: str, hf, folder: str, device: str, prompts: list[list[int]], new: int = 32) -> dict:
    from shardwise.worker.serving.request import Request
    out: dict = {"prompts": len(prompts), "new_tokens": new}
    with torch.no_grad():
        hf_tokens, hf_gaps = [], []
        for p in prompts:
            g = hf.generate(torch.tensor([p], device=device), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, output_scores=True, return_dict_in_generate=True,
                            pad_token_id=0, eos_token_id=None)
            hf_tokens.append(g.sequences[0, len(p):].tolist())
            top2 = torch.stack(g.scores)[:, 0].float().topk(2, dim=-1).values
            hf_gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        # fp32 reference: transformers' model upcast, on the tokens bf16 transformers chose
        ref32 = cast(hf, torch.float32)
        ref_logits = []
        for p, toks in zip(prompts, hf_tokens):
            ids = torch.tensor([p + toks[:-1]], device=device)
            ref_logits.append(ref32(ids).logits[0, len(p) - 1:].float().cpu())
        cast(hf, torch.bfloat16)
        hf16_err, hf16_logits = [], []
        for p, toks, ref in zip(prompts, hf_tokens, ref_logits):
            ids = torch.tensor([p + toks[:-1]], device=device)
            got = hf(ids).logits[0, len(p) - 1:].float().cpu()
            hf16_logits.append(got)
            hf16_err.append(float((got - ref).norm() / ref.norm()))
    results = {}
    for decode in ("eager", "graphs", "compile") if device == "cuda" else ("eager",):
        w = Worker(folder, device, "bfloat16", decode, max_batch=len(prompts), max_seq=max(map(len, prompts)) + new + 8)
        try:
            reqs = w.engine(len(prompts)).generate([Request(list(p), max_new_tokens=new) for p in prompts])
            ours = [r.token_ids for r in reqs]
            errs, agree, tie_gaps = [], 0, []
            for p, toks, ref, hf16 in zip(prompts, hf_tokens, ref_logits, hf16_logits):
                got = teacher_forced_logits(w, p, toks[:-1])
                errs.append(float((got - ref).norm() / ref.norm()))
                # On the same tokens: where the worker's choice differs from transformers' bf16
                # choice, how close the fp32 reference's top two were.
                same_choice = got.argmax(-1) == hf16.argmax(-1)
                agree += int(same_choice.sum())
                top2 = ref.topk(2, dim=-1).values
                tie_gaps += (top2[:, 0] - top2[:, 1])[~same_choice].tolist()
        finally:
            w.stop()
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new) for x, y in zip(ours, hf_tokens)]
        first_diff_gap = [hf_gaps[k][i] if i < new else None for k, i in enumerate(same)]
        results[decode] = {"equal_prefix": same, "all_equal": all(s == new for s in same),
                           "gap_at_first_difference": first_diff_gap,
                           "rel_error_vs_fp32": errs, "teacher_forced_same_argmax": agree,
                           "teacher_forced_positions": len(prompts) * new,
                           "fp32_top2_gap_where_argmax_differs": tie_gaps}
        say(f"  parity {decode:<8}: greedy tokens equal to transformers bf16 for "
            f"{', '.join(map(str, same))} of {new}"
            + ("" if all(s == new for s in same) else
               f" (transformers' top-2 logit gap where they part: {first_diff_gap})")
            + f"; bf16 logits vs fp32: rel. error {max(errs):.2e} (transformers bf16: {max(hf16_err):.2e}); "
            f"on transformers' tokens the same argmax at {agree}/{len(prompts) * new} positions"
            + (f" (fp32 top-2 gap where not: max {max(tie_gaps):.3f})" if tie_gaps else ""))
    # transformers' bf16 the way it generates: the prompt, then one token per step with its cache
    hf16_steps_err = []
    with torch.no_grad():
        for p, toks, ref in zip(prompts, hf_tokens, ref_logits):
            o = hf(torch.tensor([p], device=device), use_cache=True)
            rows, cache = [o.logits[0, -1].float().cpu()], o.past_key_values
            for tok in toks[:-1]:
                o = hf(torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
                rows.append(o.logits[0, -1].float().cpu())
                cache = o.past_key_values
            got = torch.stack(rows)
            hf16_steps_err.append(float((got - ref).norm() / ref.norm()))
    say(f"  transformers bf16 vs fp32, rel. error of logits: one forward over the sequence "
        f"{max(hf16_err):.2e}; prefill then one cached step per token {max(hf16_steps_err):.2e}")
    out["hf_bf16_stepwise_rel_error_vs_fp32"] = hf16_steps_err
    out["hf_bf16_rel_error_vs_fp32"] = hf16_err
    out["worker"] = results
    return out


def layer_errors(shape: str, hf, folder: str, device: str, prompt: list[int]) -> dict:
    """Where bf16 error against fp32 builds up, layer by layer, over one prompt: transformers in
    bf16, and the worker's model in bf16 run three ways (its plain forward as loaded; after
    install_fused_weights; as a cached prefill, the engine's first step). Relative error of each
    layer's output (and of the logits) against transformers in fp32."""
    from shardwise.worker.weights.loader import load_stage, open_model
    ids = torch.tensor([prompt], device=device)
    n = SHAPES[shape]["num_hidden_layers"]

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    with torch.no_grad():
        cast(hf, torch.float32)
        ref = hf(ids, output_hidden_states=True)
        ref_h, ref_logits = [h.cpu() for h in ref.hidden_states[1:n]], ref.logits[0].float().cpu()
        cast(hf, torch.bfloat16)
        got = hf(ids, output_hidden_states=True)
        rows = {"transformers bf16": ([rel(h.cpu(), r) for h, r in zip(got.hidden_states[1:n], ref_h)],
                                      rel(got.logits[0].cpu(), ref_logits))}
        model = load_stage(open_model(folder), 0, n, True, True, device=device, dtype=torch.bfloat16)
        outs: list = []
        for i in range(n - 1):
            model.layers[str(i)].register_forward_hook(lambda mod, inp, out: outs.append(out.cpu()))

        def run(name, fn):
            outs.clear()
            logits = fn()[0].float().cpu()
            rows[name] = ([rel(h, r) for h, r in zip(outs, ref_h)], rel(logits, ref_logits))
        run("worker bf16, plain forward", lambda: model(ids))
        install_fused_weights(model)
        run("worker bf16, fused", lambda: model(ids))
        model.setup_caches(1, len(prompt) + 8)
        row = torch.tensor([0], device=device)

        def cached(x, positions):
            return model(x, positions=positions, cache=cache_view(model, positions, row))
        run("worker bf16, cached prefill", lambda: cached(ids, torch.arange(len(prompt), device=device)[None]))
        # the last 16 prompt tokens as decode steps after a cached prefill of the rest (logits only)
        k, m = 16, len(prompt) - 16
        model.setup_caches(1, len(prompt) + 8)
        cached(ids[:, :m], torch.arange(m, device=device)[None])
        steps = [cached(ids[:, j:j + 1], torch.tensor([[j]], device=device))[0, -1].float().cpu()
                 for j in range(m, m + k)]
        hf_steps = hf(ids).logits[0, m:].float().cpu()
        rows["worker bf16, decode steps"] = ([float("nan")] * (n - 1), rel(torch.stack(steps), ref_logits[m:]))
        rows["transformers bf16, same rows"] = ([float("nan")] * (n - 1), rel(hf_steps, ref_logits[m:]))
    picks = sorted(i for i in {0, 1, n // 4, n // 2, 3 * n // 4, n - 2} if i < n - 1)
    say(f"  bf16 error against fp32 by layer output ({len(prompt)}-token prompt): "
        + ", ".join(f"layer {i}" for i in picks) + ", logits")
    for name, (errs, logit_err) in rows.items():
        say(f"    {name:<30} " + "  ".join(f"{errs[i]:.2e}" for i in picks) + f"  {logit_err:.2e}")
    return {name: {"layers": errs, "logits": le} for name, (errs, le) in rows.items()}


# ------------------------------------------------------------------ batch-1 decode

def hf_decode(hf, prompt: list[int], new: int, static: bool, device: str, rounds: int) -> tuple[float, float]:
    """transformers' generate: (seconds per decode token, seconds to first token)."""
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if static:
        kw["cache_implementation"] = "static"
    timer = Timer(device)

    def run(n):
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    t0 = time.perf_counter()
    run(new)                                  # warm-up (and, with the static cache, compilation)
    run(new)
    warm = time.perf_counter() - t0
    t1 = min(timer.median(lambda: run(1), repeats=1, warmup=0) for _ in range(rounds))
    tn = min(timer.median(lambda: run(new), repeats=1, warmup=0) for _ in range(rounds))
    say(f"    transformers {'static cache' if static else 'dynamic cache'}: warm-up {warm:.0f} s")
    return (tn - t1) / (new - 1), t1


def worker_decode(folder: str, device: str, mode: str, prompt: list[int], new: int, rounds: int):
    """The worker at batch 1 (`mode`: a --decode value, with ":int8" for --quantize int8):
    (seconds per decode token, seconds to first token, weight bytes)."""
    from shardwise.worker.serving.request import Request
    decode, _, quantize = mode.partition(":")
    w = Worker(folder, device, "bfloat16" if device == "cuda" else "float32", decode, max_batch=1,
               max_seq=len(prompt) + new + 8, quantize=quantize or "none")
    try:
        engine = w.engine(1)
        t0 = time.perf_counter()
        engine.generate([Request(list(prompt), max_new_tokens=8)])
        engine.generate([Request(list(prompt), max_new_tokens=8)])
        warm = time.perf_counter() - t0
        per_token, ttft = [], []
        for _ in range(rounds):
            req = Request(list(prompt), max_new_tokens=new)
            t0 = time.perf_counter()
            engine.generate([req])
            ttft.append(req.first_token_at - t0)
            per_token.append((req.finished_at - req.first_token_at) / (new - 1))
        say(f"    worker {mode}: load {w.load_s:.0f} s, warm-up {warm:.0f} s")
        return min(per_token), min(ttft), w.ctx.loaded[0]["weight_bytes"]
    finally:
        w.stop()


def decode_speed(shape: str, hf, folder: str, device: str, ceil: dict, prompt: list[int], new: int,
                 rounds: int, modes: list[str]) -> dict:
    bw = ceil["copy_bandwidth"]
    # bytes one decode step must read: every weight once and the context's keys and values
    # (on average the prompt plus half the new tokens)
    kv = kv_bytes_per_position(shape) * (len(prompt) + new / 2)
    rows = {}
    for mode in modes:
        if mode.startswith("transformers"):
            s, ttft = hf_decode(hf, prompt, new, mode.endswith("static"), device, rounds)
            wb = weight_bytes(hf)
        else:
            s, ttft, wb = worker_decode(folder, device, mode, prompt, new, rounds)
        rows[mode] = {"tokens_per_s": 1 / s, "ms_per_token": 1e3 * s, "ttft_ms": 1e3 * ttft,
                      "weight_bytes": wb, "bandwidth_use": (wb + kv) / s / bw}
        r = rows[mode]
        say(f"  {shape} decode {mode:<22}: {r['tokens_per_s']:8.1f} tok/s  {r['ms_per_token']:6.3f} ms/token  "
            f"{100 * r['bandwidth_use']:5.1f}% of copy bandwidth")
    return rows


# ------------------------------------------------------------------ where a decode step's time goes

def profile_decode(shape: str, folder: str, device: str, ceil: dict, prompt: list[int], modes: list[str]) -> dict:
    """For each --decode mode with a graph: the GPU time of one replayed step (no engine, no host
    work), and the kernels of one step by CUDA time (the step run outside the graph, under the
    profiler). Then cuBLAS's matrix-vector product with the weight [out, in] viewed transposed
    against a contiguous [in, out] copy, for the model's matrix shapes."""
    from torch.profiler import ProfilerActivity, profile

    from shardwise.worker.serving.request import Request
    out: dict = {}
    timer = Timer(device)
    for mode in modes:
        w = Worker(folder, device, "bfloat16", mode, max_batch=1, max_seq=len(prompt) + 72)
        try:
            w.engine(1).generate([Request(list(prompt), max_new_tokens=8)])
            graphed = w.ctx.stage.graphed
            graph, x_in, ints_in, _ = graphed.graphs[1]
            unpack(ints_in, 1)[0].fill_(len(prompt) + 8)       # the position; its blocks stay as last replayed
            replay_s = timer.median(graph.replay, repeats=50)
            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    graphed.static_step(1, x_in, ints_in)       # the step the graph replays, uncaptured
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
            kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6 / 10
            launches = sum(e.count for e in kernels) / 10
        finally:
            w.stop()
        wb = w.ctx.loaded[0]["weight_bytes"]
        out[mode] = {"replay_ms": 1e3 * replay_s, "kernel_ms": 1e3 * kernel_s, "kernels_per_step": launches,
                     "replay_bandwidth_use": wb / replay_s / ceil["copy_bandwidth"]}
        say(f"  {shape} --decode {mode}: one graph replay {1e3 * replay_s:.3f} ms "
            f"({100 * out[mode]['replay_bandwidth_use']:.1f}% of copy bandwidth for the weights); "
            f"{launches:.0f} kernels per step, {1e3 * kernel_s:.3f} ms of kernel time")
        say(table)
    s = SHAPES[shape]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    q = s["num_attention_heads"] * s["head_dim"] + 2 * s["num_key_value_heads"] * s["head_dim"]
    x = torch.randn(1, h, device=device, dtype=torch.bfloat16)
    xi = torch.randn(1, i, device=device, dtype=torch.bfloat16)
    gemv = {}
    for name, rows, cols, vec in (("qkv", h, q, x), ("gate_up", h, 2 * i, x), ("down", i, h, xi), ("head", h, v, x)):
        wt = torch.randn(cols, rows, device=device, dtype=torch.bfloat16)      # [out, in]
        copy = wt.t().contiguous()                                             # [in, out]
        # 100 products back to back per timing: one alone would time the launch and the sync
        a = timer.median(lambda: [vec @ wt.t() for _ in range(100)], repeats=5) / 100
        b = timer.median(lambda: [vec @ copy for _ in range(100)], repeats=5) / 100
        nbytes = wt.numel() * 2
        gemv[name] = {"out_in_view_tbs": nbytes / a / 1e12, "in_out_copy_tbs": nbytes / b / 1e12}
        say(f"  matrix-vector {name} [{rows} -> {cols}]: weight [out, in] viewed transposed "
            f"{nbytes / a / 1e12:.2f} TB/s, contiguous [in, out] {nbytes / b / 1e12:.2f} TB/s")
        del wt, copy
    out["gemv"] = gemv
    return out


# ------------------------------------------------------------------ offload

def offload_speed(shape: str, folder: str, device: str, prompt: list[int], new: int = 64) -> dict:
    """Decode with half of the model's weights streamed from pinned host memory (worker/weights/offload.py)
    against the model held whole, eager both (a graph cannot capture the streaming): the same
    tokens, the slowdown, and the overlap reached between copying and computing:
        overlap = (copy time + compute time - step time) / the smaller of the two,
    1 when the smaller hides entirely behind the larger, 0 when they run one after the other."""
    from shardwise.worker.weights.loader import load_stage, open_model
    from shardwise.worker.weights.offload import apply_offload, tensor_bytes
    source = open_model(folder)
    n = source.config.num_layers
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timer = Timer(device)

    def build(budget):
        model = load_stage(source, 0, n, True, True, device="cpu", dtype=dtype)
        install_fused_weights(model)
        plan = apply_offload(model, budget, device) if budget else model.to(device)
        return model, plan

    def decode(model):
        model.setup_caches(1, len(prompt) + new + 8)
        slot = torch.tensor([0], device=device)
        tokens = []
        with torch.no_grad():
            pos = torch.arange(len(prompt), device=device)[None]
            logits = model(torch.tensor([prompt], device=device), positions=pos,
                           cache=cache_view(model, pos, slot), last_only=True)
            tokens.append(int(logits[0, -1].argmax()))
            timer.sync()
            t0 = time.perf_counter()
            for i in range(new - 1):
                pos = torch.tensor([[len(prompt) + i]], device=device)
                logits = model(torch.tensor([[tokens[-1]]], device=device), positions=pos,
                               cache=cache_view(model, pos, slot), last_only=True)
                tokens.append(int(logits[0, -1].argmax()))
            timer.sync()
        return tokens, (time.perf_counter() - t0) / (new - 1)

    whole, _ = build(0)
    total = tensor_bytes(whole)
    decode(whole)
    want, compute_s = decode(whole)
    del whole
    if device == "cuda":
        torch.cuda.empty_cache()
    model, plan = build(total // 2)
    decode(model)
    got, step_s = decode(model)
    streamer = model.before_layer.__self__
    host = [streamer.host[name] for name in plan.streamed]
    slot = streamer.slots[0]

    def copy_all():
        for buf in host:
            slot.copy_(buf, non_blocking=True)
    copy_s = timer.median(copy_all, repeats=5)
    streamed_bytes = sum(b.numel() for b in host)
    overlap = (copy_s + compute_s - step_s) / min(copy_s, compute_s)
    out = {"budget_bytes": total // 2, "model_bytes": total, "streamed_layers": len(plan.streamed), "layers": n,
           "same_tokens": got == want, "tokens_compared": len(want), "step_ms_whole": 1e3 * compute_s,
           "step_ms_offload": 1e3 * step_s, "slowdown": step_s / compute_s, "copy_ms_per_step": 1e3 * copy_s,
           "copy_gbs": streamed_bytes / copy_s / 1e9, "overlap": overlap}
    say(f"  offload, budget half of {total / 2**30:.2f} GiB: {len(plan.streamed)} of {n} layers streamed; "
        f"tokens {'equal' if got == want else 'DIFFER'} ({len(want)}); step {1e3 * step_s:.2f} ms against "
        f"{1e3 * compute_s:.2f} ms whole ({step_s / compute_s:.2f}x); copying the streamed layers alone "
        f"{1e3 * copy_s:.2f} ms ({streamed_bytes / copy_s / 1e9:.1f} GB/s); overlap {overlap:.2f}")
    return out


# ------------------------------------------------------------------ batched decode, TTFT

def batched(folder: str, device: str, decode: str, batches: list[int], prompt: list[int], new: int,
            long_prompt: list[int]) -> dict:
    from shardwise.worker.serving.request import Request
    top = max(batches)
    w = Worker(folder, device, "bfloat16" if device == "cuda" else "float32", decode, max_batch=top,
               max_seq=max(len(prompt) + new, len(long_prompt) + 8) + 8)
    out = {}
    try:
        engine = w.engine(top)
        for b in batches:                                   # warm-up: capture every bucket used
            engine.generate([Request(list(prompt), max_new_tokens=4) for _ in range(b)])
        for b in batches:
            reqs = [Request(list(prompt), max_new_tokens=new) for _ in range(b)]
            t0 = time.perf_counter()
            engine.generate(reqs)
            wall = time.perf_counter() - t0
            # decoding with every request running: from the last first token to the last finish
            start = max(r.first_token_at for r in reqs)
            decode_s = max(r.finished_at for r in reqs) - start
            out[b] = {"tokens_per_s": b * new / wall, "decode_tokens_per_s": b * (new - 1) / decode_s}
            say(f"  batch {b:>3}: {out[b]['tokens_per_s']:8.0f} tok/s overall (prefills included), "
                f"{out[b]['decode_tokens_per_s']:8.0f} tok/s while all {b} decode")
        ttft = []
        for _ in range(5):
            req = Request(list(long_prompt), max_new_tokens=1)
            t0 = time.perf_counter()
            engine.generate([req])
            ttft.append(req.first_token_at - t0)
        out["ttft_ms"] = 1e3 * statistics.median(ttft)
        out["ttft_prompt_tokens"] = len(long_prompt)
        say(f"  time to first token, {len(long_prompt)}-token prompt: {out['ttft_ms']:.1f} ms (median of 5)")
    finally:
        w.stop()
    return out


# ------------------------------------------------------------------ training

def train_run(folder: str, data: str, ckdir: str, device: str, dtype: str, steps: int, batch: int, seq: int,
              extra: list[str] = ()) -> list[dict]:
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", folder, "--data", data, "--checkpoint-dir",
           ckdir, "--steps", str(steps), "--checkpoint-every", str(10 * steps), "--batch-size", str(batch),
           "--seq-len", str(seq), "--device", device, "--dtype", dtype, "--json", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"train on {device} {dtype} failed:\n{res.stderr[-3000:]}")
    return [r for r in (json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")) if "loss" in r]


def training(folder: str, small_folder: str, workdir: str, ceil: dict, params: int, shape: str,
             device: str) -> dict:
    import random
    rnd = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards brew potent elixirs".split()
    data = os.path.join(workdir, "train.txt")
    with open(data, "w") as f:
        f.write("\n".join(" ".join(rnd.choice(words) for _ in range(14)) for _ in range(20000)))
    s = SHAPES[shape]
    out = {}
    batch, seq, steps = 4, 1024, 20
    recs = train_run(folder, data, os.path.join(workdir, "ck-big"), device, "bfloat16", steps, batch, seq)
    tps = statistics.median(r["tokens_per_s"] for r in recs[3:])
    # 6 FLOPs per parameter per token (forward and backward), plus attention's 12 * layers * hidden * seq
    flops_per_token = 6 * params + 12 * s["num_hidden_layers"] * s["hidden_size"] * seq
    out["big"] = {"tokens_per_s": tps, "mfu_vs_measured_matmul": tps * flops_per_token / ceil["matmul_flops"],
                  "batch": batch, "seq": seq, "losses": [r["loss"] for r in recs]}
    say(f"  train {shape} bf16 on the GPU, batch {batch} x {seq}: {tps:.0f} tok/s, "
        f"MFU {100 * out['big']['mfu_vs_measured_matmul']:.1f}% of the measured bf16 matmul rate")
    # loss curve: a small model, bf16 on the GPU against fp32 on the CPU, the same data and steps
    steps = 40
    gpu = train_run(small_folder, data, os.path.join(workdir, "ck-gpu"), device, "bfloat16", steps, 8, 256)
    cpu = train_run(small_folder, data, os.path.join(workdir, "ck-cpu"), "cpu", "float32", steps, 8, 256)
    gaps = [abs(g["loss"] - c["loss"]) / c["loss"] for g, c in zip(gpu, cpu)]
    out["curve"] = {"gpu_bf16": [g["loss"] for g in gpu], "cpu_fp32": [c["loss"] for c in cpu],
                    "max_rel_gap": max(gaps), "final_rel_gap": gaps[-1]}
    say(f"  loss curve, small model, {steps} steps: GPU bf16 {gpu[0]['loss']:.3f} -> {gpu[-1]['loss']:.3f}, "
        f"CPU fp32 {cpu[0]['loss']:.3f} -> {cpu[-1]['loss']:.3f}; largest relative gap {max(gaps):.2e}, "
        f"last {gaps[-1]:.2e}")
    return out


# ------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--sections", default="parity,decode,profile,batched,train")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only to try the script")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--batched-decode", default="graphs", help="the worker's --decode for the batched section")
    ap.add_argument("--modes", default="eager,graphs,compile,transformers-dynamic,transformers-static",
                    help="the worker's --decode values (a suffix :int8 adds --quantize int8) and transformers-*")
    ap.add_argument("--dir", default="/tmp/shardwise-gpu-bench")
    ap.add_argument("--json", default="", help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device (this benchmark runs on a GPU machine)")
    sections = set(args.sections.split(","))
    os.makedirs(args.dir, exist_ok=True)
    ceil = ceilings(args.device)
    report = {"ceilings": ceil, "models": {}}
    g = torch.Generator().manual_seed(1)
    for shape in args.models.split(","):
        folder = os.path.join(args.dir, shape)
        hf = make_model(shape, folder, args.device)
        vocab = min(SHAPES[shape]["vocab_size"], 32000)
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
        r = report["models"][shape] = {"params": sum(p.numel() for p in hf.parameters()),
                                       "weight_bytes": weight_bytes(hf)}
        if "parity" in sections:
            prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 33, 128)]
            r["parity"] = parity(shape, hf, folder, args.device, prompts)
        if "layers" in sections:
            r["layers"] = layer_errors(shape, hf, folder, args.device, prompt)
        if "decode" in sections:
            modes = [m for m in args.modes.split(",") if args.device == "cuda" or m.startswith("eager")]
            r["decode"] = decode_speed(shape, hf, folder, args.device, ceil, prompt, args.new_tokens,
                                       args.rounds, modes)
        if "profile" in sections and args.device == "cuda":
            r["profile"] = profile_decode(shape, folder, args.device, ceil, prompt, ["graphs", "compile"])
        if "offload" in sections:
            r["offload"] = offload_speed(shape, folder, args.device, prompt)
        if "batched" in sections:
            long_prompt = torch.randint(0, vocab, (1000,), generator=g).tolist()
            r["batched"] = batched(folder, args.device, args.batched_decode if args.device == "cuda" else "eager",
                                   [int(b) for b in args.batches.split(",")], prompt[:64], 128, long_prompt)
        if "train" in sections:
            del hf
            small = os.path.join(args.dir, "small")
            if not os.path.isfile(os.path.join(small, "config.json")):
                make_model("tiny", small, "cpu")
            r["train"] = training(folder, small, args.dir, ceil, r["params"], shape, args.device)
        else:
            del hf
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
