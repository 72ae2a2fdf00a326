"""Training's side of its checkpoints: writing a rank's slices through DCP, and the commit
protocol that makes a written checkpoint visible, prunes old ones and clears cut-off writes.

The format itself (full-tensor slices, the `step-NNNNNNNN/` folder, its COMPLETE marker) and its
reading are defined in weights/checkpoint_format.py, since any rank opens a checkpoint as a model;
training code finds those names here too. The tiers that save and resume a rank's state (the shared
tier, asynchronous, and the node-local one) are in checkpoint_tiers.py.

Commit protocol. A checkpoint is written into `.tmp-step-NNNNNNNN-<attempt>/`; when every rank's
data and DCP's `.metadata` are on disk, rank 0 writes `meta.json` and `COMPLETE` (file list with
sizes), fsyncs them and renames the folder to `step-NNNNNNNN/`. A checkpoint cut off anywhere in
the middle of a write therefore never carries the final name with a marker, which is all a reader
trusts. Replicated slices (norms under TP, optimizer steps) are written once: DCP's planner drops
duplicates that have the same name and offsets.

Fencing. Two runs can write one directory at once: a pod on a NotReady node is force-deleted and
replaced while it may still be writing. So that neither destroys the other's work:
- Every run has an attempt, a random token (rank 0 draws it, the others receive it), and its temp
  folders carry it. A run removes its own attempt's leftovers at once; another attempt's only when
  nothing in it has been written for STALE_TEMP_S (a live writer keeps its files' mtimes fresh), so
  a run never deletes a live run's in-flight data, and a dead run's leftovers go within the bound.
- A commit never replaces a committed checkpoint. It renames the temp folder to the final name,
  which POSIX refuses when a non-empty folder of that name exists: the first commit of a step
  wins and a later writer of the same step drops its own copy (both hold the state of the same
  step; a reader must never see a committed step change under it). Only a final folder that fails
  verification (damaged) is first moved aside, atomically, and then replaced. This needs no
  pointer file and keeps the layout every reader already knows (`step-N/` with its marker).
- Pruning and clearing first rename a folder to `.del-...` and delete it afterwards, so a reader
  sees a checkpoint whole or not at all, never half deleted.
"""
from __future__ import annotations

import base64
import errno
import json
import os
import re
import secrets
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter

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


def write_slices(path: str | Path | StorageWriter, slices: dict[str, Slice], group: dist.ProcessGroup | None) -> None:
    """Collective over `group`: every rank writes its slices; the coordinator writes DCP metadata.
    `path`: a folder, or DCP's writer of a checkpoint kept elsewhere (an object store)."""
    writer = path if isinstance(path, StorageWriter) else dcp.FileSystemWriter(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({k: s.tensor for k, s in slices.items()}, storage_writer=writer,
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


# A temp folder of another attempt untouched this long belongs to a run that is gone.
STALE_TEMP_S = 3600.0
TEMP_DIR = re.compile(r"^\.tmp-step-(\d{8,})(?:-([0-9a-f]+))?$")
DELETING = ".del-"        # prefix of a folder being deleted (renamed first, so it vanishes at once)


def new_attempt() -> str:
    """A fresh attempt token: 48 random bits, as 12 hex digits."""
    return secrets.token_hex(6)


def agree_attempt(group: dist.ProcessGroup | None) -> str:
    """Collective over `group`: the attempt token rank 0 of the group draws, on every rank (they all
    write into one temp folder). Without a group, this process's own token."""
    if group is None:
        return new_attempt()
    token = torch.tensor([int(new_attempt(), 16)], dtype=torch.int64)
    dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
    return f"{int(token.item()):012x}"


def temp_dir(root: Path, step: int, attempt: str) -> Path:
    """The folder one attempt writes a step into before it commits it."""
    return root / f".tmp-{step_dir_name(step)}-{attempt}"


def _remove(path: Path) -> None:
    """Make `path` vanish at once (one rename), then delete it."""
    gone = path.with_name(f"{DELETING}{path.name.lstrip('.')}-{secrets.token_hex(4)}")
    try:
        os.rename(path, gone)
    except OSError:   # removed meanwhile by another cleaner
        return
    shutil.rmtree(gone, ignore_errors=True)


def marker_record(step: int, files: dict[str, int], attempt: str | None = None) -> dict:
    """The COMPLETE marker of a step: every file written before it, with its size (and, in an
    object store, which attempt's copy is the committed one)."""
    return {"step": step, "files": files, **({"attempt": attempt} if attempt else {})}


def to_prune(steps: list[int], keep: int) -> list[int]:
    """Of the committed steps (oldest first), those that keep-N deletes: all but the newest `keep`."""
    return list(steps[:-keep]) if keep > 0 else []


def is_own_or_stale(folder_attempt: str | None, attempt: str | None, age_s: float, stale_after: float) -> bool:
    """Whether a run with `attempt` may remove an uncommitted write of `folder_attempt` last
    touched `age_s` seconds ago: its own at once, another run's only once it is stale."""
    return (attempt is not None and folder_attempt == attempt) or age_s > stale_after


def commit(tmp: Path, final: Path, meta: dict) -> bool:
    """Make a fully written checkpoint visible: meta + marker, fsync, then one atomic rename that
    never replaces a committed checkpoint. True if this copy became `final`; False if a complete
    checkpoint of the step was already there (this copy is then dropped)."""
    _write_durable(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MARKER}
    _write_durable(tmp / MARKER, json.dumps(marker_record(meta["step"], files), sort_keys=True))
    _fsync_dir(tmp)
    for _ in range(3):   # each retry follows the removal of a damaged final folder
        try:
            os.rename(tmp, final)   # a directory onto a non-empty one: EEXIST/ENOTEMPTY, never replaced
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        else:
            _fsync_dir(final.parent)
            return True
        try:
            verify(final, meta.get("format", FORMAT))
        except CheckpointError:   # a damaged copy (say, a stale one from before a crash): replace it
            _remove(final)
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    raise CheckpointError(f"checkpoint {final} could not be committed: it keeps reappearing damaged")


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints."""
    removed = []
    done = dict(committed(root))
    for step in to_prune(sorted(done), keep):
        _remove(done[step])
        removed.append(done[step])
    return removed


def _last_written(path: Path) -> float:
    """The newest mtime of a folder and of what it directly holds (a writer's files change)."""
    newest = path.lstat().st_mtime
    with os.scandir(path) as entries:
        for n, entry in enumerate(entries):
            if n >= 100_000:   # bound the walk: a folder that large is not one of ours
                break
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    return newest


def _is_leftover(p: Path, attempt: str | None, now: float, stale_after: float) -> bool:
    if p.name.startswith(DELETING):
        return True
    if STEP_DIR.match(p.name):   # a final name is only ever made by rename, marker included
        return not (p / MARKER).exists()
    m = TEMP_DIR.match(p.name)
    if not m:
        return False
    try:
        return is_own_or_stale(m.group(2), attempt, now - _last_written(p), stale_after)
    except OSError:
        return False


def clean_partial(root: Path, attempt: str | None = None, stale_after: float = STALE_TEMP_S) -> list[Path]:
    """Remove what cut-off writes left: `attempt`'s own temp folders, other attempts' temp folders
    untouched for `stale_after` seconds (never a live run's), final-named folders without a marker
    and folders left mid-deletion. Returns what was removed."""
    if not root.is_dir():
        return []
    now = time.time()
    removed = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and not p.is_symlink() and _is_leftover(p, attempt, now, stale_after):
            if p.name.startswith(DELETING):   # already renamed: another cleaner may be deleting it too
                shutil.rmtree(p, ignore_errors=True)
            else:
                _remove(p)
            removed.append(p)
    return removed


def commit_delay(step: int) -> float:
    """SHARDWISE_CHECKPOINT_COMMIT_DELAY_S = "SECONDS" or "STEP:SECONDS" (fault-injection tests)."""
    value = os.environ.get("SHARDWISE_CHECKPOINT_COMMIT_DELAY_S", "")
    if not value:
        return 0.0
    at, _, seconds = value.rpartition(":")
    return float(seconds) if not at or int(at) == step else 0.0


def newest_shared(root: str | Path) -> tuple[int, dict] | None:
    """newest_in for the shared tier in the folder `root`."""
    return newest_in(ClaimStore(root))


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


# ---------------------------------------------------------------- where the shared tier is kept

class ClaimStore:
    """The shared tier on a file system every rank sees (a ReadWriteMany claim): the commit
    protocol above, step by step. S3CheckpointStore (checkpoint_s3.py) answers the same calls for
    an object store; CheckpointManager uses either."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __str__(self) -> str:
        return str(self.root)

    def where(self, step: int) -> str:
        return str(self.root / step_dir_name(step))

    def open(self, attempt: str) -> None:
        """Rank 0, once per run: create the root and clear what cut-off writes left."""
        self.root.mkdir(parents=True, exist_ok=True)
        clean_partial(self.root, attempt)

    def begin(self, step: int, attempt: str, coordinator: bool) -> None:
        """Before any rank writes: rank 0 makes a fresh temp folder (the others wait on a barrier)."""
        tmp = temp_dir(self.root, step, attempt)
        if coordinator:
            if tmp.exists():   # this run's own earlier try at the step (no other run writes here)
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)

    def writer(self, step: int, attempt: str) -> Path:
        tmp = temp_dir(self.root, step, attempt)
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def commit(self, step: int, attempt: str, meta: dict, files: dict[str, bytes]) -> bool:
        tmp = temp_dir(self.root, step, attempt)
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        return commit(tmp, self.root / step_dir_name(step), meta)

    def prune(self, keep: int) -> list[str]:
        return [p.name for p in prune(self.root, keep)]

    def clean(self, attempt: str | None) -> list[str]:
        return [p.name for p in clean_partial(self.root, attempt)]

    def steps(self) -> list[int]:
        """Committed steps (marker present), oldest first."""
        return [step for step, _ in committed(self.root)]

    def verify(self, step: int) -> dict:
        return verify(self.root / step_dir_name(step))

    def read(self, step: int, slices: dict[str, Slice]) -> None:
        read_slices(self.root / step_dir_name(step), slices)

    def shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        return stored_shapes(self.root / step_dir_name(step))


def newest_in(store: Any) -> tuple[int, dict] | None:
    """(step, meta) of the newest committed checkpoint of a store that passes verification
    (quietly: a resume warns when it skips one), or None."""
    for step in reversed(store.steps()):
        try:
            return step, store.verify(step)
        except CheckpointError:
            continue
    return None
