"""The header of a GGUF file (llama.cpp's model format), read with plain `struct`: no torch, no numpy.

One reader for both sides: the planner and `shardwise inspect` size a model from its header
(modelshape.from_gguf), and every worker rank that opens a GGUF file reads its metadata (tokenizer
included) and its tensor index here (worker/weights/gguf_index.py maps the tensor data). The `gguf`
package's own reader turns every vocabulary string into a numpy array, which takes seconds for a
50k-token vocabulary, and needs numpy, which the operator image lacks.

Layout (versions 2 and 3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 metadata
count; the metadata as (string key, u32 value type, value); per tensor (string name, u32 number of
dims, u64 dims fastest-varying first, u32 ggml type, u64 offset into the data); then the tensor data
from the next multiple of `general.alignment` (32 by default). A string is a u64 length and UTF-8.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Metadata value types: the scalars by their struct format, and the string and the array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# ggml tensor types -> (name, bytes per block, elements per block); float types by their torch names
GGML_TYPES = {0: ("float32", 4, 1), 1: ("float16", 2, 1), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32),
              6: ("Q5_0", 22, 32), 7: ("Q5_1", 24, 32), 8: ("Q8_0", 34, 32), 9: ("Q8_1", 36, 32),
              10: ("Q2_K", 84, 256), 11: ("Q3_K", 110, 256), 12: ("Q4_K", 144, 256), 13: ("Q5_K", 176, 256),
              14: ("Q6_K", 210, 256), 15: ("Q8_K", 292, 256), 24: ("int8", 1, 1), 25: ("int16", 2, 1),
              26: ("int32", 4, 1), 27: ("int64", 8, 1), 28: ("float64", 8, 1), 30: ("bfloat16", 2, 1)}
# No string in a real header comes near this; a longer one means a damaged length field.
_MAX_STRING = 1 << 24


class GGUFError(ValueError):
    """A header that cannot be read; the message says why (the caller adds the file's name)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]      # GGUF's order: fastest-varying first (numpy's shape reversed)
    ggml_type: int
    offset: int                # absolute file offset of the data


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    metadata_span: tuple[int, int]   # the bytes of the metadata pairs: a rewrite of the file copies them


class _Reader:
    """Sequential reads that never pass the end of the file (a cut file is "ends early", not a
    huge allocation from a damaged length)."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            raise GGUFError("GGUF header ends early")
        self.pos += n
        return self.f.read(n)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise GGUFError("GGUF string length is implausible; the file is damaged")
        return self.take(n).decode("utf-8", "replace")

    def value(self, kind: int, arrays: bool) -> Any:
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in SCALARS:    # one read for the whole array (token scores, token types)
                fmt = SCALARS[item]
                data = self.take(struct.calcsize(fmt) * count)
                return list(struct.unpack(f"<{count}{fmt[1]}", data)) if arrays else count
            items = [self.value(item, arrays) for _ in range(count)]
            return items if arrays else count
        raise GGUFError(f"GGUF metadata value type {kind} is unknown")


def read_header(path: str | Path, arrays: bool = True, limit: int | None = None) -> Header:
    """The header of the GGUF file at `path`; GGUFError if it is not one or is cut short.

    arrays=False gives each metadata array as its length (the planner needs only the vocabulary
    size, and skips decoding the token strings' scores). `limit`: read no more than that many bytes
    (a header longer than that "ends early"), for files nobody vouches for."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        reader = _Reader(f, size if limit is None else min(size, limit))
        f.seek(0)
        if reader.take(4) != MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        return _read(reader, arrays)


def _read(r: _Reader, arrays: bool) -> Header:
    version = r.unpack("<I")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    start = r.pos
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.unpack("<I"), arrays)
    span = (start, r.pos)
    entries = []
    for _ in range(n_tensors):
        name = r.string()
        dims = tuple(r.unpack("<Q") for _ in range(r.unpack("<I")))
        entries.append((name, dims, r.unpack("<I"), r.unpack("<Q")))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-r.pos // align) * align
    tensors = [TensorEntry(name, dims, kind, data_start + offset) for name, dims, kind, offset in entries]
    return Header(version, metadata, tensors, span)
