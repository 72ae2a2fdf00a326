"""Reading DCP's `.metadata` of a checkpoint without running code from it.

DCP stores its index (every tensor's full shape, which chunk of which file covers which region) as
a pickle, and its FileSystemReader loads it with `pickle.load`: a checkpoint folder someone else
wrote (downloaded, or on a volume another tenant can write) could then run any code in the process
that merely opens it. Here the same file is read by an unpickler that knows only the classes DCP's
metadata is made of (the DCP metadata dataclasses, torch.Size, dtypes, memory formats, layouts, a
path) and refuses any other global with a one-line error naming the file; what it builds is then
checked for shape (the types DCP expects, and file names that stay inside the checkpoint folder).
SafeFileSystemReader is DCP's reader with that loader, so `dcp.load` never unpickles either.
"""
from __future__ import annotations

import enum
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

METADATA_FILE = ".metadata"
# DCP's index is a few hundred bytes per stored chunk: 256 MiB is a million chunks, far above any
# model this project trains, and it bounds what a hostile file makes the reader hold.
MAX_METADATA_BYTES = 256 * 1024 * 1024

_DCP_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in _DCP_CLASSES
       if hasattr(dcp_metadata, n)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by name
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,   # StorageMeta.checkpoint_id: kept as a plain name
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class UnsafeCheckpoint(Exception):
    """A `.metadata` that is not plain DCP metadata: one line naming the file."""


def _enum_member(cls: Any, name: Any) -> Any:
    """What `getattr` may build in a `.metadata`: an enum member of one of the allowed classes (some
    Pythons pickle an enum member as getattr(its class, its name)), nothing else."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in _ALLOWED.values()
            and isinstance(name, str) and name in cls.__members__):
        return cls.__members__[name]
    raise UnsafeCheckpoint("refused to load, it calls getattr on something other than an enum member "
                           "(the file may be built to run code)")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._getattr
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        # vars(), not getattr(): torch's module __getattr__ would import submodules on a name
        if module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.memory_format)):
            return vars(torch)[name]
        raise UnsafeCheckpoint(f"{self.where}: refused to load, it names {module}.{name}, which checkpoint "
                               f"metadata never holds (the file may be built to run code)")

    def _getattr(self, cls: Any, name: Any) -> Any:
        try:
            return _enum_member(cls, name)
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{self.where}: {e}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.where}: refused to load, it holds a persistent reference")


def _check_shape(md: Any, where: str) -> None:
    """The unpickled object is DCP metadata, and every data file it names is inside the folder."""
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpoint(f"{where}: not DCP checkpoint metadata")
    for key, value in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(
                value, (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)):
            raise UnsafeCheckpoint(f"{where}: entry {str(key)[:80]!r} is not a tensor or bytes description")
    storage = md.storage_data if md.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise UnsafeCheckpoint(f"{where}: its storage index is not a mapping")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if (not isinstance(info, dcp_filesystem._StorageInfo) or not isinstance(name, str)
                or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
                or not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0 or info.transform_descriptors):
            raise UnsafeCheckpoint(f"{where}: its storage index names {str(name)[:80]!r}, "
                                   f"not a plain data file of the checkpoint folder")


def load_metadata(folder: str | Path, name: str = METADATA_FILE) -> dcp_metadata.Metadata:
    """DCP's metadata of the checkpoint in `folder`, read without unpickling anything but DCP's
    metadata classes; UnsafeCheckpoint (one line) for anything else, OSError if unreadable."""
    path = Path(folder) / name
    with open(path, "rb") as f:
        return load_metadata_stream(f, os.fstat(f.fileno()).st_size, str(path))


def load_metadata_stream(f: Any, size: int, where: str) -> dcp_metadata.Metadata:
    """load_metadata's rules for metadata of `size` bytes read from the binary stream `f` (a file,
    or an object of a store); `where` names it in messages."""
    if size > MAX_METADATA_BYTES:
        raise UnsafeCheckpoint(f"{where}: {size} bytes, more than the {MAX_METADATA_BYTES} "
                               f"checkpoint metadata may have")
    try:
        md = _MetadataUnpickler(f, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated or garbage: a pickle error of any kind
        raise UnsafeCheckpoint(f"{where}: not readable checkpoint metadata ({type(e).__name__})") from None
    _check_shape(md, where)
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader whose metadata comes from load_metadata, never from pickle.load.
    `metadata`, when given, is what load_metadata already returned for this folder (a caller that
    checks it first gets a one-line error before DCP logs its own for a refused file)."""

    def __init__(self, path: str | os.PathLike, metadata: dcp_metadata.Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            md = self._metadata
        else:
            md = load_metadata(self.path, Path(self._get_metadata_path(rank)).name)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
