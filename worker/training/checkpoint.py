"""Training's side of its checkpoints: writing a rank's slices through DCP, and the commit
protocol that makes a written checkpoint visible, prunes old ones and clears cut-off writes.

The format itself (full-tensor slices, the `step-NNNNNNNN/` folder, its COMPLETE marker) and its
reading are defined in weights/checkpoint_format.py, since any rank opens a checkpoint as a model;
training code finds those names here too. The tiers that save and resume a rank's state (the shared
tier, asynchronous, and the node-local one) are in checkpoint_tiers.py.

Commit protocol. A checkpoint is written into `.tmp-step-NNNNNNNN/`; when every rank's data and
DCP's `.metadata` are on disk, rank 0 writes `meta.json` and `COMPLETE` (file list with sizes),
fsyncs them and renames the folder to `step-NNNNNNNN/`. A checkpoint cut off anywhere in the middle
of a write therefore never carries the final name with a marker, which is all a reader trusts.
Replicated slices (norms under TP, optimizer steps) are written once: DCP's planner drops
duplicates that have the same name and offsets.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardwise.worker.weights.checkpoint_format import (  # noqa: F401  (training's names for the format)
    FORMAT, MARKER, META, STEP_DIR, CheckpointError, CheckpointMismatch, Slice, committed, latest_complete,
    read_slices, resolve, step_dir_name, stored_shapes, verify)

# The files of a model that a checkpoint carries, so that it serves as a model by itself.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")
STRUCTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "tie_word_embeddings")


# ---------------------------------------------------------------- writing slices through DCP

class _SliceSavePlanner(DefaultSavePlanner):
    """Writes each Slice as one chunk of its full tensor (DCP dedups identical replicated chunks)."""

    def __init__(self, slices: dict[str, Slice]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         dedup_save_to_lowest_rank=True)
        self.slices = slices

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, s in self.slices.items():
            if s.tensor.numel() == 0:   # a rank holding only vocabulary padding has nothing to write
                continue
            offsets = torch.Size(s.offsets)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=s.tensor.shape),
                    properties=TensorProperties.create_from_tensor(s.tensor),
                    size=torch.Size(s.full_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.slices[index.fqn].tensor


def write_slices(path: str | Path, slices: dict[str, Slice], group: dist.ProcessGroup | None) -> None:
    """Collective over `group`: every rank writes its slices; the coordinator writes DCP metadata."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({k: s.tensor for k, s in slices.items()}, storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=_SliceSavePlanner(slices), process_group=group,
                 no_dist=group is None and not dist.is_initialized())


# ---------------------------------------------------------------- the commit protocol

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, final: Path, meta: dict) -> None:
    """Make a fully written checkpoint visible: meta + marker, fsync, then one atomic rename."""
    _write_durable(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MARKER}
    _write_durable(tmp / MARKER, json.dumps({"step": meta["step"], "files": files}, sort_keys=True))
    _fsync_dir(tmp)
    if final.exists():  # a stale copy of the same step (written before a crash): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints, and leftovers of cut-off writes."""
    removed = []
    done = committed(root)
    for _, p in done[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def clean_partial(root: Path) -> None:
    """Remove folders a crash left behind mid-write (run before the first save of a new run)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(".tmp-step-") or (STEP_DIR.match(p.name) and not (p / MARKER).exists()):
            shutil.rmtree(p, ignore_errors=True)


def commit_delay(step: int) -> float:
    """SHARDWISE_CHECKPOINT_COMMIT_DELAY_S = "SECONDS" or "STEP:SECONDS" (fault-injection tests)."""
    value = os.environ.get("SHARDWISE_CHECKPOINT_COMMIT_DELAY_S", "")
    if not value:
        return 0.0
    at, _, seconds = value.rpartition(":")
    return float(seconds) if not at or int(at) == step else 0.0


def newest_shared(root: str | Path) -> tuple[int, dict] | None:
    """(step, meta) of the newest committed checkpoint under `root` that passes verification
    (quietly: a resume warns when it skips one), or None."""
    for step, path in reversed(committed(root)):
        try:
            return step, verify(path)
        except CheckpointError:
            continue
    return None


def rng_to_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def rng_from_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def check_writable(path: str | Path) -> None:
    """Create `path` if needed and write, fsync and delete a file in it; OSError if that fails."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-test-{os.getpid()}"
    try:
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def check_same_model(stored: dict, wanted: dict, path: Path | str) -> None:
    diffs = [f"{k}={stored.get(k)!r} (this model: {wanted.get(k)!r})"
             for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)]
    if diffs:
        raise CheckpointMismatch(f"checkpoint {path} was written for a different model: " + ", ".join(diffs[:4]))


def structure_of(config_dict: dict) -> dict:
    """The part of a model config that decides tensor names and shapes (what must match to load)."""
    return {k: config_dict.get(k) for k in STRUCTURE}
