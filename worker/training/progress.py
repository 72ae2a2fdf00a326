"""What training reports: the lines rank 0 prints (text, or one JSON object per step with
--json), `<checkpoint_dir>/progress.json` that a pod's status is read from, and the newest
checkpoint a status report shows."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training.options import TrainOptions, layout_record


def emitter(opts: TrainOptions, lead: bool, out) -> Callable[[dict], None]:
    """What rank 0 prints of each record (the other ranks print nothing)."""
    def emit(rec: dict) -> None:
        if not lead:
            return
        if opts.json:   # stdout: exactly one object per step; other news as text on stderr
            if "loss" in rec:
                print(json.dumps(rec), file=out, flush=True)
            elif rec.get("message"):
                print(rec["message"], file=sys.stderr, flush=True)
        elif "loss" in rec:
            extra = f"  checkpoint {rec['checkpoint']}" if rec.get("checkpoint") else ""
            extra += " (local)" if rec.get("checkpoint_tier") == "local" else ""
            print(f"step {rec['step']:>6}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                  f"grad-norm {rec['grad_norm']:.3f}  {rec['tokens_per_s']:.0f} tok/s{extra}", file=out, flush=True)
        elif rec.get("event") in ("resume", "start", "done", "log"):
            print(rec.get("message", json.dumps(rec)), file=out, flush=True)
    return emit


def announce(trainer, meta: dict | None, emit) -> None:
    """Where the run starts (`trainer`, a trainer.Trainer): a fresh start, or the checkpoint (and
    tier) it resumed from."""
    opts = trainer.opts
    if meta is not None and trainer.resumed_from["tier"] == "local":
        shared = trainer.manager.last_committed
        emit({"event": "resume", "step": trainer.step, "tier": "local", "from_layout": meta.get("layout"),
              "message": f"resumed from local checkpoint step {trainer.step} ({_layout_text(meta.get('layout'))}, "
                         f"each rank's own files in {opts.local_checkpoint_dir}; newest shared checkpoint: "
                         f"{'none' if shared is None else f'step {shared[0]}'})"})
    elif meta is not None:
        emit({"event": "resume", "step": trainer.step, "tier": "shared", "from_layout": meta.get("layout"),
              "message": f"resumed from checkpoint step {trainer.step} "
                         f"(saved under {_layout_text(meta.get('layout'))}, now {_layout_text(layout_record(opts))})"
                         # where it was read: a job resumed from an object store says which
                         + (f" in {opts.checkpoint_uri}" if opts.checkpoint_uri else "")})
    else:
        emit({"event": "start", "step": 0, "message": f"training from {opts.model} "
              f"({_layout_text(layout_record(opts))}, {len(trainer.data)} tokens)"})


def _checkpoint_record(last: tuple[int, float] | None) -> dict | None:
    return None if last is None else {"step": last[0], "time": last[1], "name": ckpt.step_dir_name(last[0])}


def write_progress(opts: TrainOptions, trainer, rec: dict) -> None:
    """progress.json from rank 0 (`trainer`, a trainer.Trainer), replaced atomically."""
    progress = {"step": trainer.step, "steps": opts.steps, "loss": rec.get("loss"),
                "done": bool(rec.get("done")), "time": time.time(),
                "replicate_bytes": trainer.replicate_bytes, "compression": opts.compression,
                "last_checkpoint": _checkpoint_record(trainer.manager.last_committed),
                "last_local_checkpoint": _checkpoint_record(trainer.local.last_committed if trainer.local else None),
                "resumed_from": trainer.resumed_from}
    tmp = Path(opts.checkpoint_dir) / ".progress.json.tmp"
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, Path(opts.checkpoint_dir) / "progress.json")


def _layout_text(d: dict | None) -> str:
    if not d:
        return "unknown layout"
    text = f"TP={d.get('tensor')} PP={d.get('pipeline')} DP={d.get('data_parallel')}"
    shard, context = d.get("data_shard"), d.get("context") or 1
    return text + (f" (FSDP={shard})" if shard and shard > 1 else "") + (f" CP={context}" if context > 1 else "")


def last_checkpoint(checkpoint_dir: str) -> dict | None:
    """What a status report shows: step and time of the newest complete checkpoint, or None."""
    found = ckpt.latest_complete(checkpoint_dir)
    if found is None:
        return None
    step, path, meta = found
    return {"step": step, "time": meta.get("time"), "path": str(path)}


def read_progress(checkpoint_dir: str) -> dict | None:
    """`<checkpoint_dir>/progress.json` as rank 0 last wrote it, or None (not started, unreadable)."""
    try:
        return json.loads((Path(checkpoint_dir) / "progress.json").read_text())
    except (OSError, ValueError):
        return None
