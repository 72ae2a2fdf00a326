"""The header of a .safetensors file, read and checked before the `safetensors` library maps the file.

Layout: a u64 little-endian header length N, N bytes of JSON, then the tensor data. The JSON is an
object: per tensor {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data, which
follows the header), and an optional "__metadata__" object of strings.

A model directory is whatever a tenant downloaded, so nothing in the header is trusted: its length
is bounded (the format's own 100 MB limit, and the file's size), it is read in bounded chunks, its
JSON nesting is bounded before it is parsed, and every entry is checked the way the `safetensors`
library checks it - a known dtype, a shape of non-negative integers of bounded rank, offsets that
tile the data exactly and agree with shape x dtype - so that any file accepted here opens there.
Anything else is one WorkerError line naming the file.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.json_file import parse

# The format's own bound on the header (safetensors refuses a longer one too).
HEADER_MAX_BYTES = 100_000_000
_CHUNK = 1 << 20
# A valid header nests three deep: the object, a tensor's entry, its shape or offsets.
_MAX_JSON_DEPTH = 3
# No weight tensor a model loads has more dimensions than this.
MAX_RANK = 8
# Bytes per element of every dtype safetensors defines in whole bytes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def tensor_names(path: str) -> list[str]:
    """The names of the tensors in the .safetensors file at `path`, its header checked throughout."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = _header_bytes(f, path, size)
    except OSError as e:
        raise WorkerError(f"weight file {path} cannot be read: {e.strerror or e}") from None
    header = _parse(raw, path)
    _check_entries(header, path, size - 8 - len(raw))
    return [k for k in header if k != "__metadata__"]


def _header_bytes(f: Any, path: str, size: int) -> bytes:
    head = f.read(8)
    if len(head) < 8:
        raise WorkerError(f"weight file {path} is truncated ({size} bytes)")
    n = struct.unpack("<Q", head)[0]
    if n > HEADER_MAX_BYTES:
        raise WorkerError(f"weight file {path}: its header claims {n} bytes (at most {HEADER_MAX_BYTES})")
    if n > size - 8:
        raise WorkerError(f"weight file {path} is truncated (header needs {n} bytes, file has {size})")
    chunks, left = [], n
    while left:   # bounded reads: a file that shrinks underneath ends the loop, not a huge buffer
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            raise WorkerError(f"weight file {path} is truncated (header needs {n} bytes)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, path: str) -> dict[str, Any]:
    bad = f"weight file {path} is not a valid safetensors file"
    if not raw.startswith(b"{"):
        raise WorkerError(f"{bad}: its header is not a JSON object")
    header = parse(raw, f"the header of weight file {path}", _MAX_JSON_DEPTH)
    if not isinstance(header, dict):
        raise WorkerError(f"{bad}: its header is not a JSON object")
    return header


def _check_entries(header: dict[str, Any], path: str, data_bytes: int) -> None:
    """Every entry well formed, and their data_offsets tiling [0, data_bytes) with no gap or overlap."""
    bad = f"weight file {path} is not a valid safetensors file"
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WorkerError(f"{bad}: __metadata__ is not an object of strings")
    spans = sorted((_span(name, entry, bad), name) for name, entry in header.items() if name != "__metadata__")
    at = 0
    for (begin, end), name in spans:
        if begin != at:
            raise WorkerError(f"{bad}: tensor {name!r} starts at data byte {begin}, expected {at}")
        at = end
    if at != data_bytes:
        what = "truncated" if at > data_bytes else "not a valid safetensors file"
        raise WorkerError(f"weight file {path} is {what} (its tensors take {at} bytes of data, "
                          f"the file has {data_bytes})")


def _span(name: str, entry: Any, bad: str) -> tuple[int, int]:
    """One tensor's [begin, end) in the data, checked against its dtype and shape."""
    if not isinstance(entry, dict):
        raise WorkerError(f"{bad}: the entry of tensor {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WorkerError(f"{bad}: tensor {name!r} has dtype {str(dtype)[:32]!r}, not one of {', '.join(DTYPE_BYTES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_natural(d) for d in shape)):
        raise WorkerError(f"{bad}: tensor {name!r} has shape {str(shape)[:64]}, "
                          f"not a list of at most {MAX_RANK} non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise WorkerError(f"{bad}: tensor {name!r} has data_offsets {str(offsets)[:64]}, not [begin, end]")
    begin, end = offsets
    if math.prod(shape) * DTYPE_BYTES[dtype] != end - begin:
        raise WorkerError(f"{bad}: tensor {name!r} of shape {shape} {dtype} takes "
                          f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes, its data_offsets span {end - begin}")
    return begin, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
