"""The checkpoint tiers that save and resume one rank's training state.

Shared tier (CheckpointManager). Every K steps all ranks write the state in full-tensor
coordinates to the shared checkpoint directory (checkpoint.py: DCP, commit protocol) or to an
object store (checkpoint_s3.py: the same protocol on `s3://`), readable by any later layout. `save()` copies this rank's slices to CPU (the only part training waits for),
then a background thread runs the DCP write on a dedicated gloo group (so its collectives never
interleave with the training collectives) and commits. The next `save()` first waits for the
previous write to finish.

Local tier (LocalCheckpointManager). Between shared checkpoints, each rank may also save its own
state alone, to node-local storage: `<local root>/rank-<R>/step-NNNNNNNN/` holds `state.pt` (this
rank's slice tensors, torch.save), `meta.json` (step, data position, RNG, the slices' offsets and
full shapes, and a fingerprint: layout, global rank, world size, model structure) and `COMPLETE`,
written by the same commit protocol (temporary folder named with this process's attempt, fsync,
marker with file sizes, a rename that never replaces a committed step: checkpoint.py). No
collective is involved, so it is fast; it can only be read back by the same rank of the same
layout, which the fingerprint checks.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.worker.training.checkpoint import (
    FORMAT, CheckpointError, CheckpointMismatch, ClaimStore, Slice, agree_attempt, check_same_model,
    check_writable, clean_partial, commit, commit_delay, committed, fsync_file, new_attempt, newest_in, prune,
    step_dir_name, temp_dir, verify, write_slices)

LOCAL_FORMAT = "shardwise-local-checkpoint/1"
LOCAL_STATE = "state.pt"


def _join_write(manager) -> BaseException | None:
    """Wait for a manager's background write (`_thread`), if any; its failure (`_error`), taken."""
    if manager._thread is not None:
        manager._thread.join()
        manager._thread = None
    error, manager._error = manager._error, None
    return error


class CheckpointManager:
    """Saves (asynchronously) and loads the training state of one rank.

    `group` is a gloo process group over all ranks used only by checkpoint writes; `rank` is this
    rank's global rank (rank 0 commits). `model_meta` describes the model (config); a checkpoint
    whose model_meta differs is refused with a clear error. Constructing one is a collective over
    `group`: the ranks agree on the run's attempt token (the fence of its temp folders).
    """

    def __init__(self, root: str | Path | Any, *, rank: int, group: dist.ProcessGroup | None,
                 model_meta: dict, keep: int = 3, asynchronous: bool = True,
                 log: Callable[[str], None] | None = None, files: dict[str, bytes] | None = None):
        # Where the tier is kept: a folder (ClaimStore) or an object store (S3CheckpointStore).
        self.store = ClaimStore(root) if isinstance(root, (str, Path)) else root
        self.rank = rank
        self.group = group
        self.model_meta = model_meta
        self.keep = keep
        self.asynchronous = asynchronous
        self.log = log or (lambda msg: None)
        self.files = files or {}   # config/tokenizer written alongside, so a checkpoint is a model too
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocking_s = 0.0   # time training waited in the last save()
        self.last_write_s = 0.0      # time the last write took end to end
        self.last_committed: tuple[int, float] | None = None  # (step, unix time)
        self.attempt = agree_attempt(group)
        if rank == 0:
            self.store.open(self.attempt)

    # -- save
    def save(self, step: int, slices: dict[str, Slice], extra: dict) -> None:
        t0 = time.perf_counter()
        self.wait()
        # The copy is what training waits for; afterwards the optimizer may change the tensors.
        cpu = {k: dataclasses.replace(s, tensor=s.tensor.detach().to("cpu", copy=True)) for k, s in slices.items()}
        meta = {"format": FORMAT, "step": step, "time": time.time(), "model": self.model_meta, **extra}
        if self.asynchronous:
            self._thread = threading.Thread(target=self._write, args=(step, cpu, meta, t0),
                                            name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(step, cpu, meta, t0)
        self.last_blocking_s = time.perf_counter() - t0

    def _write(self, step: int, slices: dict[str, Slice], meta: dict, t0: float) -> None:
        try:
            self.store.begin(step, self.attempt, self.rank == 0)
            if self.group is not None:
                dist.barrier(group=self.group)  # the folder exists before anyone writes into it
            write_slices(self.store.writer(step, self.attempt), slices, self.group)
            delay = commit_delay(step)
            if delay:  # fault injection: widen the window between "written" and "committed"
                time.sleep(delay)
            if self.rank == 0:
                if self.store.commit(step, self.attempt, meta, self.files):
                    self.log(f"checkpoint {step_dir_name(step)} committed")
                else:
                    self.log(f"checkpoint {step_dir_name(step)} was already committed by another run: kept that one")
                for name in self.store.prune(self.keep):
                    self.log(f"removed old checkpoint {name}")
                self.store.clean(self.attempt)   # other runs' leftovers, once stale
            self.last_committed = (step, meta["time"])
            self.last_write_s = time.perf_counter() - t0
        except BaseException as e:  # surfaced on the next save()/wait() in the training thread
            self._error = e

    def wait(self) -> None:
        """Block until the write in flight (if any) is committed; re-raise its failure."""
        e = _join_write(self)
        if e is not None:
            raise CheckpointError(f"checkpoint write failed: {type(e).__name__}: {e}") from e

    # -- load
    def load_latest(self, slices: dict[str, Slice], agree: Callable[[int], int] | None = None) -> dict | None:
        """Fill `slices` from the newest usable checkpoint and return its meta; None if there is none.

        A checkpoint that fails verification or reading is skipped with a warning (falling back to
        the previous one); a checkpoint of a different model is an error, never silently skipped.
        `agree(code)` returns the minimum of `code` over all ranks, so that every rank loads the
        same checkpoint even when only one of them finds a damaged file.
        """
        agree = agree or (lambda code: code)
        FATAL, SKIP, OK = 0, 1, 2
        for step in reversed(self.store.steps()):
            code, error, meta = OK, None, None
            path = self.store.where(step)
            try:
                meta = self.store.verify(step)
                self.check_model(meta, path)
                self.store.read(step, slices)
            except CheckpointError as e:
                code, error = (FATAL if isinstance(e, CheckpointMismatch) else SKIP), e
            agreed = agree(code)
            if agreed == FATAL:
                raise error if code == FATAL else CheckpointMismatch(
                    f"checkpoint {path} was written for a different model")
            if agreed == SKIP:
                why = error or f"checkpoint {path} is damaged on another rank"
                warnings.warn(f"{why}; falling back to the previous checkpoint", stacklevel=2)
                continue
            self.last_committed = (step, meta.get("time", 0.0))
            return meta
        return None

    def newest(self) -> tuple[int, dict] | None:
        """(step, meta) of the newest complete checkpoint of this tier, or None."""
        return newest_in(self.store)

    def check_model(self, meta: dict, path: Path | str) -> None:
        check_same_model(meta.get("model", {}), self.model_meta, path)


class LocalCheckpointManager:
    """The local tier of one rank: its own slices, no collective, in `<root>/rank-<R>/`.

    `fingerprint` identifies what can read a local checkpoint back (layout, global rank, world
    size, model structure): `matching_steps()` lists only this rank's complete checkpoints with
    exactly this fingerprint. Writes run in a background thread like the shared tier's (the copy
    to CPU is what training waits for); a failed local write is a warning, not a failure of the
    job (the shared tier is the durable one).
    """

    def __init__(self, root: str | Path, *, rank: int, fingerprint: dict, keep: int = 2,
                 asynchronous: bool = True, log: Callable[[str], None] | None = None):
        self.root = Path(root)
        self.dir = self.root / f"rank-{rank}"
        self.rank = rank
        self.fingerprint = fingerprint
        self.keep = keep
        self.asynchronous = asynchronous
        self.log = log or (lambda msg: None)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocking_s = 0.0
        self.last_write_s = 0.0
        self.last_committed: tuple[int, float] | None = None
        self.attempt = new_attempt()   # this process alone writes its rank's folder
        check_writable(self.dir)
        clean_partial(self.dir, self.attempt)

    # -- save
    def save(self, step: int, slices: dict[str, Slice], extra: dict) -> None:
        t0 = time.perf_counter()
        self.wait()
        cpu = {k: s.tensor.detach().to("cpu", copy=True) for k, s in slices.items()}
        meta = {"format": LOCAL_FORMAT, "step": step, "time": time.time(), "fingerprint": self.fingerprint,
                "slices": {k: {"full_shape": list(s.full_shape), "offsets": list(s.offsets),
                               "shape": list(s.tensor.shape)} for k, s in slices.items()}, **extra}
        if self.asynchronous:
            self._thread = threading.Thread(target=self._write, args=(step, cpu, meta, t0),
                                            name=f"local-checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(step, cpu, meta, t0)
        self.last_blocking_s = time.perf_counter() - t0

    def _write(self, step: int, tensors: dict[str, torch.Tensor], meta: dict, t0: float) -> None:
        tmp = temp_dir(self.dir, step, self.attempt)
        try:
            if tmp.exists():   # this process's own earlier try at the step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            torch.save(tensors, tmp / LOCAL_STATE)
            fsync_file(tmp / LOCAL_STATE)
            delay = commit_delay(step)
            if delay:  # fault injection: widen the window between "written" and "committed"
                time.sleep(delay)
            commit(tmp, self.dir / step_dir_name(step), meta)
            prune(self.dir, self.keep)
            clean_partial(self.dir, self.attempt)
            self.last_committed = (step, meta["time"])
            self.last_write_s = time.perf_counter() - t0
        except BaseException as e:  # reported on the next save()/wait()
            self._error = e

    def wait(self) -> None:
        """Block until the local write in flight (if any) is done; a failure is one warning."""
        e = _join_write(self)
        if e is not None:
            warnings.warn(f"local checkpoint in {self.dir} failed: {type(e).__name__}: {e}", stacklevel=2)

    # -- load
    def matching_steps(self) -> list[int]:
        """This rank's complete local checkpoints whose fingerprint is exactly ours, oldest first."""
        steps = []
        for step, path in committed(self.dir):
            try:
                meta = verify(path, LOCAL_FORMAT)
            except CheckpointError:
                continue
            if meta.get("fingerprint") == self.fingerprint and meta.get("step") == step:
                steps.append(step)
        return steps

    def load(self, step: int, slices: dict[str, Slice]) -> dict:
        """Fill `slices` in place from this rank's local checkpoint of `step`; return its meta."""
        path = self.dir / step_dir_name(step)
        meta = verify(path, LOCAL_FORMAT)
        try:
            stored = torch.load(path / LOCAL_STATE, map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged file: skip this checkpoint
            raise CheckpointError(f"local checkpoint {path} cannot be read: {type(e).__name__}: {e}"
                                  .splitlines()[0]) from None
        described = meta.get("slices", {})
        if set(stored) != set(slices) or set(described) != set(slices):
            raise CheckpointError(f"local checkpoint {path} holds other tensors than this rank's")
        for name, s in slices.items():
            t, d = stored[name], described[name]
            if (tuple(t.shape) != tuple(s.tensor.shape) or tuple(d["full_shape"]) != tuple(s.full_shape)
                    or tuple(d["offsets"]) != tuple(s.offsets)):
                raise CheckpointError(f"local checkpoint {path}: {name!r} is another slice than this rank's")
        with torch.no_grad():
            for name, s in slices.items():
                s.tensor.copy_(stored[name])
        self.last_committed = (step, meta.get("time", 0.0))
        return meta
