"""Training benchmark: tokens/s per layout, checkpoint time that blocks training (asynchronous
against synchronous save), and load-and-reshard time of a checkpoint into other layouts.

    python benchmarks/train_bench.py [--steps 12] [--hidden 256] [--layers 4] [--layouts 1x1x1,2x1x1,1x2x1,1x1x2]

Everything runs on this machine (local processes, gloo on CPU) with a random Llama written for the
purpose; the figures are ratios against baselines measured in the same run:
  * tokens/s of each layout against TP=1 x PP=1 x DP=1;
  * time a checkpoint save blocks the training step, async against the synchronous save;
  * load of a TP=2 checkpoint into TP=1, TP=4 and PP=2 slices against loading it in its own layout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _text(n_lines: int = 3000) -> str:
    rnd = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew potent "
             "elixirs under the pale moon and many small birds sing").split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(14)) for _ in range(n_lines))


def _train(model: Path, data: Path, ckdir: Path, layout: tuple[int, int, int], steps: int, every: int,
           extra: list[str], batch: int, seq: int) -> list[dict]:
    t, p, d = layout
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", str(model), "--data", str(data),
           "--checkpoint-dir", str(ckdir), "--steps", str(steps), "--checkpoint-every", str(every),
           "--tensor-parallel", str(t), "--pipeline-parallel", str(p), "--data-parallel", str(d),
           "--batch-size", str(batch), "--seq-len", str(seq), "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"train {layout} failed:\n{out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines()]


def _slices_for(config, folder: Path, tp: int, rank: int, stage: tuple[int, int] | None):
    """Model + optimizer slices one rank of a layout would load (built without processes): the
    rank's part of each full tensor by inference's split (parallel.py), in full-tensor coordinates."""
    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.worker.model.llama import Transformer
    from shardwise.worker.distributed.tensor_parallel import apply_tensor_parallel

    start, end = stage or (0, config.num_layers)
    with torch.device("meta"):
        m = Transformer(config, start, end, start == 0, end == config.num_layers)
    apply_tensor_parallel(m, rank, tp, group=None)
    m.to_empty(device="cpu")
    shapes = ckpt.stored_shapes(folder)
    out = {}
    for name, p in m.named_parameters():
        full = shapes[f"model/{name}"]
        shard = m.tp_shards.get(name)
        if shard is None:
            part, offsets = p.data, (0,) * p.dim()
        else:
            lo, hi = shard.bounds(full[shard.dim])
            part = p.data.narrow(shard.dim, 0, max(0, min(hi, full[shard.dim]) - lo))   # no padding rows
            offsets = tuple(lo if d == shard.dim else 0 for d in range(p.dim()))
        out[f"model/{name}"] = ckpt.Slice(part, tuple(full), offsets)
        for moment in ("exp_avg", "exp_avg_sq"):   # AdamW moments have the parameter's shape and split
            out[f"optim/{name}/{moment}"] = ckpt.Slice(torch.empty_like(part), tuple(full), offsets)
    return out


def _load_time(folder: Path, config, tp: int, pp: int) -> float:
    """Slowest rank's time to read its slices of `folder` under TP=tp x PP=pp (ranks in turn)."""
    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.crds.layout import split_layers

    times = []
    for stage in split_layers(config.facts(), pp).ranges:
        for rank in range(tp):
            slices = _slices_for(config, folder, tp, rank, stage)
            best = float("inf")
            for _ in range(3):   # best of 3: the page cache is warm for every layout alike
                t0 = time.perf_counter()
                ckpt.read_slices(folder, slices)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
    return max(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layouts", default="1x1x1,2x1x1,1x2x1,1x1x2", help="TxPxD list")
    args = ap.parse_args()

    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.weights.tiny import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="train-bench-"))
    data = work / "data.txt"
    data.write_text(_text())
    model = write_tiny_model(work / "model", _text(300), layers=args.layers, hidden=args.hidden,
                             heads=8, kv_heads=4, intermediate=args.hidden * 3, vocab=2000)
    config = open_model(str(model)).config
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {config.vocab_size}, "
          f"{config.num_params / 1e6:.1f}M parameters; batch {args.batch_size} x {args.seq_len} tokens; "
          f"{os.cpu_count()} CPU cores; fp32, gloo")

    # 1. tokens/s per layout (median over steps after the first two, which warm up)
    print("\ntraining throughput (no checkpoints)")
    base = None
    for spec in args.layouts.split(","):
        layout = tuple(int(x) for x in spec.split("x"))
        recs = _train(model, data, work / f"tput-{spec}", layout, args.steps, 0, [],
                      args.batch_size, args.seq_len)
        tps = statistics.median(r["tokens_per_s"] for r in recs[2:-1])
        base = base or tps
        print(f"  TP={layout[0]} PP={layout[1]} DP={layout[2]} ({layout[0] * layout[1] * layout[2]} ranks): "
              f"{tps:8.0f} tokens/s  ({tps / base:.2f}x of TP=1)")

    # 2. checkpoint time that blocks a training step: async (copy to CPU, write in background) vs sync
    print("\ncheckpoint save, time the training step waits (TP=2, every 2 steps)")
    blocking = {}
    for mode, extra in (("sync", ["--sync-checkpoint"]), ("async", [])):
        recs = _train(model, data, work / f"ck-{mode}", (2, 1, 1), args.steps, 2, extra + ["--keep", "2"],
                      args.batch_size, args.seq_len)
        saves = [r["checkpoint_blocking_s"] for r in recs if "checkpoint_blocking_s" in r]
        # the last save also waits for the one before it to finish: report the steady state
        blocking[mode] = statistics.median(saves[:-1] or saves)
    size = sum(f.stat().st_size for f in ckpt.committed(work / "ck-sync")[-1][1].iterdir())
    print(f"  checkpoint size {size / 2**20:.1f} MiB (model + AdamW moments)")
    print(f"  synchronous save blocks {blocking['sync'] * 1000:8.1f} ms per checkpoint")
    print(f"  asynchronous save blocks {blocking['async'] * 1000:7.1f} ms per checkpoint "
          f"({blocking['sync'] / max(blocking['async'], 1e-9):.0f}x less)")

    # 3. load-and-reshard: the TP=2 checkpoint read by each rank of other layouts
    folder = ckpt.committed(work / "ck-sync")[-1][1]
    _load_time(folder, config, 1, 1)   # warm the page cache
    own = _load_time(folder, config, 2, 1)
    print("\nload a TP=2 checkpoint (model + optimizer), slowest rank")
    print(f"  into TP=2 (as saved):   {own * 1000:8.1f} ms")
    for tp, pp in ((1, 1), (4, 1), (1, 2), (2, 2)):
        t = _load_time(folder, config, tp, pp)
        print(f"  into TP={tp} PP={pp} (reshard): {t * 1000:6.1f} ms  ({t / own:.2f}x of the saved layout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
