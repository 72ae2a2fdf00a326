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
# Bounds on what a header may claim, so that a damaged or hostile file is refused before it costs
# time or memory: no string in a real header comes near _MAX_STRING (a longer one means a damaged
# length field); metadata arrays nest one level in real files (a list of strings), so deeper than
# _MAX_ARRAY_DEPTH is refused rather than recursed into; ggml tensors have at most 4 dimensions.
_MAX_STRING = 1 << 24
_MAX_ARRAY_DEPTH = 4
_MAX_DIMS = 4
# The fewest bytes one item can take in the file, so a count larger than the bytes left is refused
# at once: a metadata pair (u64 key length, u32 type, a 1-byte value), a tensor entry (u64 name
# length, u32 dims, u32 type, u64 offset), a string (its u64 length), an array (u32 type, u64 count).
_MIN_PAIR, _MIN_TENSOR, _MIN_STRING, _MIN_ARRAY = 13, 24, 8, 12
# No ggml type stores an element in less than one bit (IQ1_S takes 1.56), so a tensor of more
# elements than 8 a byte of the file is a damaged dims field, whatever its type.
_MAX_ELEMENTS_PER_BYTE = 8


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

    def left(self) -> int:
        return self.size - self.pos

    def count(self, what: str, n: int, least: int) -> int:
        """`n` items of at least `least` bytes each, refused when the rest of the file cannot hold them."""
        if n * least > self.left():
            raise GGUFError(f"GGUF {what} count {n} is more than the file holds; the file is damaged or truncated")
        return n

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            raise GGUFError("GGUF header ends early (the file is truncated)")
        self.pos += n
        return self.f.read(n)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise GGUFError("GGUF string length is implausible; the file is damaged")
        return self.take(n).decode("utf-8", "replace")

    def value(self, kind: int, arrays: bool, depth: int = 0) -> Any:
        """One metadata value. An array of arrays is read depth-first, refused beyond _MAX_ARRAY_DEPTH;
        with arrays=False an array is kept as its length only (nothing per item is held)."""
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GGUFError(f"GGUF metadata value type {kind} is unknown")
        if depth >= _MAX_ARRAY_DEPTH:
            raise GGUFError(f"GGUF metadata arrays nest deeper than {_MAX_ARRAY_DEPTH}; the file is damaged")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in SCALARS:    # one read for the whole array (token scores, token types)
            fmt = SCALARS[item]
            data = self.take(self.count("array", count, struct.calcsize(fmt)) * struct.calcsize(fmt))
            return list(struct.unpack(f"<{count}{fmt[1]}", data)) if arrays else count
        if item not in (STRING, ARRAY):
            raise GGUFError(f"GGUF metadata array of unknown value type {item}")
        self.count("array", count, _MIN_STRING if item == STRING else _MIN_ARRAY)
        if not arrays:
            for _ in range(count):
                self.value(item, False, depth + 1)
            return count
        return [self.value(item, True, depth + 1) for _ in range(count)]


def read_header(path: str | Path, arrays: bool = True, limit: int | None = None) -> Header:
    """The header of the GGUF file at `path`; GGUFError (one line, without the file's name: the
    caller adds it) if it is not one, is cut short, or claims more than the file holds.

    arrays=False gives each metadata array as its length (the planner needs only the vocabulary
    size, and skips decoding the token strings' scores). `limit`: read no more than that many bytes
    (a header longer than that "ends early"), for files nobody vouches for. Every tensor's data must
    lie inside the file, so a reader of the index never maps past its end."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        reader = _Reader(f, size if limit is None else min(size, limit))
        f.seek(0)
        if reader.take(4) != MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        header = _read(reader, arrays)
    _check_extents(header.tensors, size)
    return header


def _read(r: _Reader, arrays: bool) -> Header:
    version = r.unpack("<I")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    r.count("metadata", n_kv, _MIN_PAIR)
    start = r.pos
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.unpack("<I"), arrays)
    span = (start, r.pos)
    r.count("tensor", n_tensors, _MIN_TENSOR)
    entries = {}
    for _ in range(n_tensors):
        name, dims = r.string(), _dims(r)
        if name in entries:
            raise GGUFError(f"GGUF tensor {name!r} is listed twice")
        entries[name] = (dims, r.unpack("<I"), r.unpack("<Q"))
    align = _alignment(metadata)
    data_start = -(-r.pos // align) * align
    tensors = [TensorEntry(name, dims, kind, data_start + offset) for name, (dims, kind, offset) in entries.items()]
    return Header(version, metadata, tensors, span)


def _dims(r: _Reader) -> tuple[int, ...]:
    n = r.unpack("<I")
    if n > _MAX_DIMS:
        raise GGUFError(f"GGUF tensor has {n} dimensions (at most {_MAX_DIMS})")
    return tuple(r.unpack("<Q") for _ in range(n))


def _alignment(metadata: dict[str, Any]) -> int:
    """general.alignment: a power of two (llama.cpp's own rule); 32 when the header does not say."""
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1) or align > 1 << 30:
        raise GGUFError(f"GGUF general.alignment {align!r} is not a power of two")
    return align


def _check_extents(tensors: list[TensorEntry], size: int) -> None:
    """Every tensor's data inside the file (`size` bytes): its element count plausible for the file
    and, for the ggml types sized here, its bytes ending by the end of the file."""
    for t in tensors:
        elements = 1
        for d in t.dims:
            elements *= d
            if elements > _MAX_ELEMENTS_PER_BYTE * size:
                raise GGUFError(f"GGUF tensor {t.name!r} has dims {list(t.dims)}, more than the file can hold")
        end = t.offset
        if t.ggml_type in GGML_TYPES:
            _, block_bytes, block_elements = GGML_TYPES[t.ggml_type]
            if t.dims and t.dims[0] % block_elements:
                raise GGUFError(f"GGUF tensor {t.name!r}: a row of {t.dims[0]} is not whole "
                                f"{GGML_TYPES[t.ggml_type][0]} blocks of {block_elements}")
            end += elements // block_elements * block_bytes
        if end > size:
            raise GGUFError(f"GGUF tensor {t.name!r} ends at byte {end}, past the end of the file "
                            f"({size} bytes; the file is truncated)")
