"""What a CPU matrix product of `--quantize gguf` costs per row, against the other products torch
offers on a CPU, and what the faster ones would cost in quality: the measurement behind the CPU
serving figures of docs/worker.md ("Where the CPU's time goes").

Part 1 times, on one SmolLM2 matrix shape (576 inputs, 1536 outputs; `--inputs`, `--outputs`),
for M = 1 .. 256 rows of activations: torch's int4 kernel (aten._weight_int4pack_mm_for_cpu, exact
values, bfloat16 activations), the block-dot kernel the GGUF blocks run on where it builds
(worker/weights/block_dot.py) with fine and with int8 activations, a bfloat16 and a float32 dense
product of the dequantized matrix, and an int8 x int8 product (torch._int_mm, oneDNN's VNNI
kernels) with the activations quantized per row. The fastest of `--rounds` rounds of each is kept, in alternating
order, so a shared machine's load moves all of them alike.

Part 2 (`--quality`) scores the built-in SmolLM2 GGUF on benchmarks/data/river.txt (teacher
forced, as the quantization tests do) with its matrices multiplied by torch's int4 kernel, by the
block-dot kernel with fine and with int8 activations, with the
weights re-quantized to int8 with one scale per row (what an int8 x int8 product needs: the file's
scale per block of 32 cannot enter it) and with the activations also quantized to int8 per row,
and prints the perplexity of each and the first greedy tokens of two prompts.

Part 3 (`--engine`) runs the engine itself on the built-in SmolLM2 GGUF under `--quantize gguf`
(2 threads): 8 requests of 150 prompt tokens and 64 new ones, then the same 8 again (their
prompts now cached), then one stream, once per product: torch's int4 kernel, the block-dot
kernel's fine mode with its 512-bit and its 256-bit path, and its int8 mode; each in a process of
its own, `--rounds-engine` alternating rounds.

    python benchmarks/cpu_matmul_bench.py [--threads 1] [--quality] [--engine]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

ROWS = (1, 8, 32, 64, 256)


def best_ms(fn, rounds: int, calls: int = 10) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], float32 scale [M, 1]): absmax / 127 per row."""
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / scale).to(torch.int8), scale


def speed(inputs: int, outputs: int, rounds: int) -> None:
    values = torch.randint(0, 16, (outputs, inputs), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    scales_zeros = torch.rand(inputs // 32, outputs, 2).to(torch.bfloat16)
    w = torch.randn(outputs, inputs)
    wb, w8 = w.bfloat16(), int8_rows(w)[0].t().contiguous()
    from shardwise.worker.weights import block_dot
    dot = block_dot.available()
    if dot:
        dot_w = block_dot.pack(values.to(torch.uint8), scales_zeros[..., 0].t().float(), scales_zeros[..., 1].t().float())
    print(f"1. one matrix of {inputs} inputs x {outputs} outputs, {torch.get_num_threads()} thread(s); "
          "ms per product (microseconds per row)")
    print(f"{'rows':>5}  {'int4 kernel':>16}  {'block-dot fine':>16}  {'block-dot int8':>16}  {'bf16 dense':>16}  "
          f"{'f32 dense':>16}  {'int8 x int8':>16}")
    for m in ROWS:
        x = torch.randn(m, inputs)
        xb = x.bfloat16()
        kinds = {
            "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, scales_zeros),
            "fine": (lambda: block_dot.mm(xb, *dot_w, True)) if dot else None,
            "dot8": (lambda: block_dot.mm(xb, *dot_w, False)) if dot else None,
            "bf16": lambda: torch.nn.functional.linear(xb, wb),
            "f32": lambda: torch.nn.functional.linear(x, w),
            # torch._int_mm takes more than 16 rows on some builds: fewer are padded, as a server would
            "int8": lambda: torch._int_mm(int8_rows(torch.cat([x, x.new_zeros(max(0, 17 - m), inputs)]))[0], w8),
        }
        got = {k: math.inf for k in kinds}
        for _ in range(rounds):
            for k, fn in kinds.items():
                if fn is not None:
                    got[k] = min(got[k], best_ms(fn, 1))
        print(f"{m:>5}  " + "  ".join(f"{got[k]:7.3f} ({got[k] / m * 1e3:5.0f})" if kinds[k] else f"{'n/a':>16}"
                                      for k in kinds))


def quality() -> None:
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.rank import LocalRuntime, RankSpec, teacher_forced_nll
    from shardwise.worker.serving.request import Request
    from shardwise.worker.weights import gguf_blocks
    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.weights.tokenizer import load_tokenizer

    tok = load_tokenizer(open_model("smollm2"))
    text = tok.encode((Path(__file__).parent / "data" / "river.txt").read_text())
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    exact = gguf_blocks.BlockLinear.mm

    def per_row(activations: bool):
        def mm(self, x):
            if not hasattr(self, "bench_w8"):
                w = self.dequantized(torch.float32)
                self.bench_w8, self.bench_ws = int8_rows(w)
                self.bench_w8 = self.bench_w8.t().float()
                self.bench_ws = self.bench_ws.t()
            xf = x.float()
            if activations:
                q, s = int8_rows(xf)
                y = (q.float() @ self.bench_w8) * s * self.bench_ws
            else:
                y = (xf @ self.bench_w8) * self.bench_ws
            y = y.to(x.dtype)
            return y if self.bias is None else y.add_(self.bias.to(x.dtype))
        return mm

    print(f"\n2. SmolLM2 Q4_1 on river.txt ({len(text)} tokens), perplexity and 12 greedy tokens")
    from shardwise.worker.weights import block_dot
    built = block_dot.available
    runs = [("int4 kernel (bf16 activations)", exact, "fine", lambda: False),
            *([("block-dot, fine activations", exact, "fine", built),
               ("block-dot, int8 activations", exact, "int8", built)] if built() else []),
            ("weights int8 per row", per_row(False), "fine", lambda: False),
            ("weights and activations int8 per row", per_row(True), "fine", lambda: False)]
    for name, mm, activations, available in runs:
        gguf_blocks.BlockLinear.mm = mm
        block_dot.available = available     # False: the blocks on torch's int4 kernel
        try:
            spec = RankSpec("smollm2", max_batch=2, max_seq=512, quantize="gguf", block_activations=activations)
            with LocalRuntime(spec) as ctx:
                ppl = math.exp(teacher_forced_nll(ctx, text))
                engine = Engine(ctx.stage, spec.max_batch, ctx.max_seq, [])
                reqs = engine.generate([Request(list(p), max_new_tokens=12) for p in prompts])
        finally:
            gguf_blocks.BlockLinear.mm, block_dot.available = exact, built
        print(f"  {name:38s} perplexity {ppl:8.3f}   " + " | ".join(repr(tok.decode(r.token_ids)) for r in reqs))


ENGINE_RUNS = {   # name -> (--block-activations, environment)
    "int4 kernel": ("fine", {"SHARDWISE_KERNEL_DIR": "", "CXX": "/bin/false", "HOME": "{tmp}"}),
    "block-dot fine": ("fine", {}),
    "block-dot fine, 256-bit": ("fine", {"SHARDWISE_BLOCK_DOT_256": "1"}),
    "block-dot int8": ("int8", {}),
}
ENGINE_ONE = """
import sys, time, torch
from shardwise.worker.serving.engine import Engine
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.serving.request import Request
spec = RankSpec("smollm2", max_batch=8, max_seq=1024, quantize="gguf", block_activations=sys.argv[1], threads=2)
with LocalRuntime(spec) as ctx:
    engine = Engine(ctx.stage, spec.max_batch, ctx.max_seq, [])
    out = []
    for _ in range(2):       # the second time, the prompts are cached
        reqs = [Request(list(range(100 + i, 250 + i)), max_new_tokens=64) for i in range(8)]
        start = time.perf_counter(); engine.generate(reqs); out.append(time.perf_counter() - start)
    start = time.perf_counter(); engine.generate([Request(list(range(7, 17)), max_new_tokens=64)])
    out.append((time.perf_counter() - start) / 64 * 1e3)
print(" ".join(f"{v:.3f}" for v in out))
"""


def engine(rounds: int) -> None:
    import os
    import subprocess
    import sys
    import tempfile
    print("\n3. the engine, SmolLM2 Q4_1, 2 threads: 8 x (150 prompt + 64 new) tokens, the same again "
          "(prompts cached), one stream")
    got = {name: [] for name in ENGINE_RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name, (activations, env) in ENGINE_RUNS.items():
                env = {**os.environ, **{k: v.format(tmp=tmp) for k, v in env.items()}}
                done = subprocess.run([sys.executable, "-c", ENGINE_ONE, activations], env=env, cwd="/",
                                      capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1:]}")
                got[name].append([float(v) for v in done.stdout.split()[-3:]])
    print(f"  {'product':26s} {'8 requests s':>14s} {'cached s':>10s} {'1 stream ms/token':>18s}   (best of {rounds})")
    for name, runs in got.items():
        best = [min(r[k] for r in runs) for k in range(3)]
        print(f"  {name:26s} {best[0]:14.2f} {best[1]:10.2f} {best[2]:18.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inputs", type=int, default=576)
    ap.add_argument("--outputs", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quality", action="store_true", help="also score SmolLM2 with each product (about a minute)")
    ap.add_argument("--engine", action="store_true", help="also time the engine with each product (minutes)")
    ap.add_argument("--rounds-engine", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    speed(args.inputs, args.outputs, args.rounds)
    if args.quality:
        quality()
    if args.engine:
        engine(args.rounds_engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
