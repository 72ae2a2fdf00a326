"""The format of a training checkpoint, and its reading: what any rank needs to open one as a
model (`--model <checkpoint>`), training to resume one, and training's writer
(training/checkpoint.py) to produce one.

Format. Every tensor is stored under its *full* name ("model/layers.3.attn.wq.weight") with its
*full* shape; each rank writes only the slice it holds, described by its offsets into the full
tensor. DCP's own metadata then records, per tensor, which stored chunk covers which region, so a
reader with any other layout asks for the region it needs and DCP reads exactly the overlapping
parts of the stored chunks (resharding). A slice is plain offsets into the full tensor: training
takes them from each DTensor shard (FSDP2 over DTensor TP included: parallelize.local_region, the
offsets DCP itself would compute), inference loaders compute them for their own slices, and no
DeviceMesh has to exist to read a checkpoint (inference ranks load without any process group).

DCP's metadata is a pickle; it is read only through checkpoint_metadata's restricted loader, which
builds DCP's metadata classes and nothing else, so opening a checkpoint never runs code from it.

Folder. A committed checkpoint is `step-NNNNNNNN/` holding DCP's files, `meta.json` and a
`COMPLETE` marker listing every file with its size. A reader only considers folders with the final
name *and* a COMPLETE marker whose listed files all exist with the listed sizes, so a checkpoint
cut off anywhere in the middle of a write is never loaded.

It lives with the weights, not with training, because a checkpoint is a model source like an HF
folder or a GGUF file: serving ranks open it without importing any training code.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader

from shardwise.worker.weights.checkpoint_metadata import SafeFileSystemReader, UnsafeCheckpoint, load_metadata

FORMAT = "shardwise-checkpoint/1"
MARKER = "COMPLETE"
META = "meta.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")


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


# ---------------------------------------------------------------- reading slices through DCP

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


def read_slices(path: str | Path, slices: dict[str, Slice], reader: StorageReader | None = None) -> None:
    """Fill each Slice's tensor in place from the checkpoint at `path`; no process group needed.
    `reader`: DCP's reader of a checkpoint kept elsewhere (an object store), its metadata already
    read and checked; `path` then only names it in messages."""
    if reader is None:
        reader = SafeFileSystemReader(str(path), _metadata(path))   # checked before DCP sees the folder
    try:
        with warnings.catch_warnings():  # "loading in a single process" is exactly what we ask for
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({k: s.tensor for k, s in slices.items()}, storage_reader=reader,
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
        if isinstance(e, UnsafeCheckpoint):
            raise CheckpointError(str(e)) from None
        raise CheckpointError(f"checkpoint {path} cannot be read: {type(e).__name__}: {e}".splitlines()[0]) from None


def _metadata(path: str | Path) -> Metadata:
    """DCP's metadata of a checkpoint through the safe loader; CheckpointError (one line) if refused."""
    try:
        return load_metadata(path)
    except UnsafeCheckpoint as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: its metadata is unreadable ({e.strerror or e})") from None


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Full name -> full shape of every tensor in a checkpoint (reads only DCP's metadata)."""
    md = _metadata(path)
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# ---------------------------------------------------------------- the checkpoint folder

def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under `root`, oldest first (marker present)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
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
    sizes = {name: (path / name).stat().st_size for name in marker.get("files", {}) if (path / name).is_file()}
    check_complete(path, marker, meta, sizes, fmt)
    return meta


def check_complete(where: str | Path, marker: dict, meta: dict, sizes: dict[str, int], fmt: str = FORMAT) -> None:
    """The rule of a complete checkpoint, wherever it is stored: its meta has the format, and every
    file its marker lists is there (`sizes`: name -> stored size) with the listed size."""
    if meta.get("format") != fmt:
        raise CheckpointError(f"checkpoint {where}: unknown format {meta.get('format')!r}")
    files = marker.get("files", {})
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {where}: its marker lists no files")
    for name, size in files.items():
        if name not in sizes:
            raise CheckpointError(f"checkpoint {where}: file {name} is missing")
        if sizes[name] != size:
            raise CheckpointError(f"checkpoint {where}: file {name} has {sizes[name]} bytes, expected {size}")


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
