"""What a CPU matrix product of `--quantize gguf` costs per row, against the other products torch
offers on a CPU, and what the faster ones would cost in quality: the measurement behind the CPU
serving figures of docs/worker.md ("Where the CPU's time goes").

Part 1 times, on one SmolLM2 matrix shape (576 inputs, 1536 outputs; `--inputs`, `--outputs`),
for M = 1 .. 256 rows of activations: the int4 kernel the GGUF blocks run on
(aten._weight_int4pack_mm_for_cpu, exact values), a bfloat16 and a float32 dense product of the
dequantized matrix, and an int8 x int8 product (torch._int_mm, oneDNN's VNNI kernels) with the
activations quantized per row. The fastest of `--rounds` rounds of each is kept, in alternating
order, so a shared machine's load moves all of them alike.

Part 2 (`--quality`) scores the built-in SmolLM2 GGUF on benchmarks/data/river.txt (teacher
forced, as the quantization tests do) with its matrices multiplied exactly (the blocks), with the
weights re-quantized to int8 with one scale per row (what an int8 x int8 product needs: the file's
scale per block of 32 cannot enter it) and with the activations also quantized to int8 per row,
and prints the perplexity of each and the first greedy tokens of two prompts.

    python benchmarks/cpu_matmul_bench.py [--threads 1] [--quality]
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
    print(f"1. one matrix of {inputs} inputs x {outputs} outputs, {torch.get_num_threads()} thread(s); "
          "ms per product (microseconds per row)")
    print(f"{'rows':>5}  {'int4 blocks':>16}  {'bf16 dense':>16}  {'f32 dense':>16}  {'int8 x int8':>16}")
    for m in ROWS:
        x = torch.randn(m, inputs)
        xb = x.bfloat16()
        kinds = {
            "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, scales_zeros),
            "bf16": lambda: torch.nn.functional.linear(xb, wb),
            "f32": lambda: torch.nn.functional.linear(x, w),
            # torch._int_mm takes more than 16 rows on some builds: fewer are padded, as a server would
            "int8": lambda: torch._int_mm(int8_rows(torch.cat([x, x.new_zeros(max(0, 17 - m), inputs)]))[0], w8),
        }
        got = {k: math.inf for k in kinds}
        for _ in range(rounds):
            for k, fn in kinds.items():
                got[k] = min(got[k], best_ms(fn, 1))
        print(f"{m:>5}  " + "  ".join(f"{got[k]:7.3f} ({got[k] / m * 1e3:5.0f})" for k in kinds))


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
    for name, mm in (("blocks (exact)", exact), ("weights int8 per row", per_row(False)),
                     ("weights and activations int8 per row", per_row(True))):
        gguf_blocks.BlockLinear.mm = mm
        try:
            spec = RankSpec("smollm2", max_batch=2, max_seq=512, quantize="gguf")
            with LocalRuntime(spec) as ctx:
                ppl = math.exp(teacher_forced_nll(ctx, text))
                engine = Engine(ctx.stage, spec.max_batch, ctx.max_seq, [])
                reqs = engine.generate([Request(list(p), max_new_tokens=12) for p in prompts])
        finally:
            gguf_blocks.BlockLinear.mm = exact
        print(f"  {name:38s} perplexity {ppl:8.3f}   " + " | ".join(repr(tok.decode(r.token_ids)) for r in reqs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inputs", type=int, default=576)
    ap.add_argument("--outputs", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quality", action="store_true", help="also score SmolLM2 with each product (about a minute)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    speed(args.inputs, args.outputs, args.rounds)
    if args.quality:
        quality()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
