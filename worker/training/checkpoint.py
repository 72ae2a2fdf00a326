"""Sharded, layout-independent training checkpoints on torch.distributed.checkpoint (DCP).

Format. Every tensor is stored under its *full* name ("model/layers.3.attn.wq.weight") with its
*full* shape; each rank writes only the slice it holds, described by its offsets into the full
tensor. DCP's own metadata then records, per tensor, which stored chunk covers which region, so a
reader with any other layout asks for the region it needs and DCP reads exactly the overlapping
parts of the stored chunks (resharding). A slice is plain offsets into the full tensor: training
takes them from each DTensor shard (FSDP2 over DTensor TP included: parallelize.local_region, the
offsets DCP itself would compute), inference loaders compute them for their own slices, and no
DeviceMesh has to exist to read a checkpoint (inference ranks load without any process group).
Replicated slices (norms under TP, optimizer steps) are written once: DCP's planner drops
duplicates that have the same name and offsets.

Commit protocol. A checkpoint is written into `.tmp-step-NNNNNNNN/`; when every rank's data and
DCP's `.metadata` are on disk, rank 0 writes `meta.json` and `COMPLETE` (file list with sizes),
fsyncs them and renames the folder to `step-NNNNNNNN/`. A reader only considers folders with the
final name *and* a COMPLETE marker whose listed files all exist with the listed sizes, so a
checkpoint cut off anywhere in the middle of a write is never loaded.

Asynchronous save. `save()` copies this rank's slices to CPU (the only part training waits for),
then a background thread runs the DCP write on a dedicated gloo group (so its collectives never
interleave with the training collectives) and commits. The next `save()` first waits for the
previous write to finish.

Local tier (LocalCheckpointManager). Between shared checkpoints, each rank may also save its own
state alone, to node-local storage: `<local root>/rank-<R>/step-NNNNNNNN/` holds `state.pt` (this
rank's slice tensors, torch.save), `meta.json` (step, data position, RNG, the slices' offsets and
full shapes, and a fingerprint: layout, global rank, world size, model structure) and `COMPLETE`,
written by the same commit protocol (temporary folder, fsync, marker with file sizes, rename). No
collective is involved, so it is fast; it can only be read back by the same rank of the same
layout, which the fingerprint checks.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType, TensorWriteData, LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

FORMAT = "shardwise-checkpoint/1"
LOCAL_FORMAT = "shardwise-local-checkpoint/1"
LOCAL_STATE = "state.pt"
MARKER = "COMPLETE"
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: one line that names the checkpoint and what is wrong."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint of a different model (other shapes or tensors): an error to stop on, where a
    damaged checkpoint is one to skip for the previous one."""


@dataclasses.dataclass
class Slice:
    """The part of one full tensor that this rank holds: `tensor` sits at `offsets` in `full_shape`."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> "Slice":
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())

    @classmethod
    def split(cls, tensor: torch.Tensor, full_shape: tuple[int, ...] | torch.Size,
              rank: int, parts: int) -> "Slice":
        """The slice of rank `rank` of `parts` equal contiguous parts (or the whole tensor if unsplit)."""
        full_shape = tuple(full_shape)
        local = tuple(tensor.shape)
        if local == full_shape:
            return cls.whole(tensor)
        dims = [d for d, (a, b) in enumerate(zip(local, full_shape)) if a != b]
        if len(local) != len(full_shape) or len(dims) != 1:
            raise ValueError(f"slice of shape {local} is not one part of {full_shape}")
        d = dims[0]
        chunk = -(-full_shape[d] // parts)  # torch.chunk: ceil-sized parts, the last may be short
        start = rank * chunk
        if local[d] != max(0, min(chunk, full_shape[d] - start)):
            raise ValueError(f"slice of shape {local} is not part {rank}/{parts} of {full_shape}")
        offsets = tuple(start if i == d else 0 for i in range(len(full_shape)))
        return cls(tensor, full_shape, offsets)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.tensor.shape)


# ---------------------------------------------------------------- DCP planners for offset slices

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


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Reads, for each wanted Slice, the parts of the stored chunks that overlap it."""

    def __init__(self, slices: dict[str, Slice], where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.slices = slices
        self.where = where

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for fqn, s in self.slices.items():
            md = stored.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointMismatch(f"checkpoint {self.where} has no tensor {fqn!r}: "
                                      f"it was written for a different model")
            if tuple(md.size) != tuple(s.full_shape):
                raise CheckpointMismatch(f"checkpoint {self.where}: {fqn!r} has shape {tuple(md.size)}, "
                                      f"this model needs {tuple(s.full_shape)}: it was written for a different model")
            if s.tensor.numel():
                items += create_read_items_for_chunk_list(fqn, md, [s.chunk()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.slices[index.fqn].tensor


def write_slices(path: str | Path, slices: dict[str, Slice], group: dist.ProcessGroup | None) -> None:
    """Collective over `group`: every rank writes its slices; the coordinator writes DCP metadata."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({k: s.tensor for k, s in slices.items()}, storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=_SliceSavePlanner(slices), process_group=group,
                 no_dist=group is None and not dist.is_initialized())


def read_slices(path: str | Path, slices: dict[str, Slice]) -> None:
    """Fill each Slice's tensor in place from the checkpoint at `path`; no process group needed."""
    try:
        with warnings.catch_warnings():  # "loading in a single process" is exactly what we ask for
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({k: s.tensor for k, s in slices.items()}, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_SliceLoadPlanner(slices, str(path)), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's failure as (exception, traceback): unwrap for one line
        failures = getattr(e, "failures", None)
        if failures:
            e = next(iter(failures.values()))
            e = e[0] if isinstance(e, tuple) else e
        if isinstance(e, CheckpointError):
            raise e from None
        raise CheckpointError(f"checkpoint {path} cannot be read: {type(e).__name__}: {e}".splitlines()[0]) from None


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Full name -> full shape of every tensor in a checkpoint (reads only DCP's metadata)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# ---------------------------------------------------------------- the checkpoint folder

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under `root`, oldest first (marker present)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def verify(path: Path, fmt: str = FORMAT) -> dict:
    """Check a committed checkpoint's files against its COMPLETE marker; return its meta.json."""
    try:
        marker = json.loads((path / MARKER).read_text())
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: marker or meta.json unreadable ({e})") from None
    if meta.get("format") != fmt:
        raise CheckpointError(f"checkpoint {path}: unknown format {meta.get('format')!r}")
    for name, size in marker.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, expected {size}")
    return meta


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
        if p.name.startswith(".tmp-step-") or (_STEP_DIR.match(p.name) and not (p / MARKER).exists()):
            shutil.rmtree(p, ignore_errors=True)


def _commit_delay(step: int) -> float:
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


# ---------------------------------------------------------------- training-side manager

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
    whose model_meta differs is refused with a clear error.
    """

    def __init__(self, root: str | Path, *, rank: int, group: dist.ProcessGroup | None,
                 model_meta: dict, keep: int = 3, asynchronous: bool = True,
                 log: Callable[[str], None] | None = None, files: dict[str, bytes] | None = None):
        self.root = Path(root)
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
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            clean_partial(self.root)

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
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        try:
            if self.rank == 0:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            if self.group is not None:
                dist.barrier(group=self.group)  # the folder exists before anyone writes into it
            else:
                tmp.mkdir(parents=True, exist_ok=True)
            write_slices(tmp, slices, self.group)
            delay = _commit_delay(step)
            if delay:  # fault injection: widen the window between "written" and "committed"
                time.sleep(delay)
            if self.rank == 0:
                for name, content in self.files.items():
                    (tmp / name).write_bytes(content)
                commit(tmp, self.root / step_dir_name(step), meta)
                for p in prune(self.root, self.keep):
                    self.log(f"removed old checkpoint {p.name}")
                self.log(f"checkpoint {step_dir_name(step)} committed")
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
        for step, path in reversed(committed(self.root)):
            code, error, meta = OK, None, None
            try:
                meta = verify(path)
                self.check_model(meta, path)
                read_slices(path, slices)
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

    def check_model(self, meta: dict, path: Path) -> None:
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
        check_writable(self.dir)
        clean_partial(self.dir)

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
        tmp = self.dir / f".tmp-{step_dir_name(step)}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            torch.save(tensors, tmp / LOCAL_STATE)
            _fsync_file(tmp / LOCAL_STATE)
            delay = _commit_delay(step)
            if delay:  # fault injection: widen the window between "written" and "committed"
                time.sleep(delay)
            commit(tmp, self.dir / step_dir_name(step), meta)
            prune(self.dir, self.keep)
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


def latest_complete(root: str | Path) -> tuple[int, Path, dict] | None:
    """The newest committed checkpoint that passes verification (falling back with a warning)."""
    for step, path in reversed(committed(root)):
        try:
            return step, path, verify(path)
        except CheckpointError as e:
            warnings.warn(f"{e}; falling back to the previous checkpoint", stacklevel=2)
    return None


def resolve(path: str | Path) -> tuple[Path, dict]:
    """A checkpoint folder given either itself or a run's checkpoint root: (folder, meta)."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path, verify(path)
    found = latest_complete(path)
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return found[1], found[2]


def is_checkpoint(path: str | Path) -> bool:
    """True for a checkpoint folder or a run's checkpoint root with at least one committed step."""
    path = Path(path)
    return (path / MARKER).is_file() or bool(committed(path))


def load_model_slices(path: str | Path, wanted: dict[str, Slice]) -> dict:
    """Inference: fill a rank's weight slices (full names without the "model/" prefix) in place.

    `path` is a checkpoint folder or a checkpoint root (newest complete step is used). The rank
    asks only for what it holds (its layers, its tensor-parallel part) and DCP reads just those
    bytes. Returns the checkpoint's meta.json (model config under "model").
    """
    folder, meta = resolve(path)
    read_slices(folder, {f"model/{k}": s for k, s in wanted.items()})
    return meta


# ---------------------------------------------------------------- inference: checkpoint as a model

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")
STRUCTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "tie_word_embeddings")


def structure_of(config_dict: dict) -> dict:
    """The part of a model config that decides tensor names and shapes (what must match to load)."""
    return {k: config_dict.get(k) for k in STRUCTURE}


def _source_class():
    from shardwise.worker.weights.loader import ModelSource
    from shardwise.worker.model.llama import ModelConfig

    class CheckpointSource(ModelSource):
        """A training checkpoint as a model for `--model`: each read fetches only the rank's slice."""

        def __init__(self, path: str):
            folder, meta = resolve(path)
            self.path = str(folder)
            self.meta = meta
            self.config = ModelConfig.from_dict(meta["model_config"])
            self.shapes = stored_shapes(folder)

        def check(self) -> None:
            missing = [k for k in ("model/norm.weight", "model/tok_embeddings.weight") if k not in self.shapes]
            if missing:
                raise CheckpointError(f"checkpoint {self.path} lacks {missing[0]}")

        def read(self, name: str, shard) -> torch.Tensor:
            key = name
            if name == "output.weight" and f"model/{name}" not in self.shapes and self.config.tie_word_embeddings:
                key = "tok_embeddings.weight"
            full = self.shapes.get(f"model/{key}")
            if full is None:
                raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
            if shard is None:
                out = torch.empty(full, dtype=torch.float32)
                read_slices(self.path, {f"model/{key}": Slice.whole(out)})
                return out
            start, stop = shard.bounds(full[shard.dim])
            real = max(0, min(stop, full[shard.dim]) - start)
            shape = list(full)
            shape[shard.dim] = stop - start
            out = torch.zeros(shape, dtype=torch.float32)   # rows past the vocabulary stay zero
            if real:
                part = out.narrow(shard.dim, 0, real)
                offsets = tuple(start if d == shard.dim else 0 for d in range(len(full)))
                read_slices(self.path, {f"model/{key}": Slice(part, tuple(full), offsets)})
            return out

    return CheckpointSource


def open_checkpoint_model(path: str):
    """loader.py format hook: a checkpoint folder (or a run's checkpoint root) as a ModelSource."""
    try:
        return _source_class()(path)
    except CheckpointError as e:
        from shardwise.worker.errors import WorkerError
        raise WorkerError(str(e)) from None


def _register() -> None:
    from shardwise.worker.weights import loader
    if not any(f.name == "checkpoint" for f in loader.FORMATS):
        loader.register_format("checkpoint", is_checkpoint, open_checkpoint_model, first=True)
