"""A GGUF file's metadata and tensor index (read by crds/gguf.py, the one GGUF header reader),
with the tensor data memory-mapped for a rank to read its rows from, and `write_requantized`.

Tensor sizes in bytes come from the `gguf` package's table, which knows every ggml type a file may
hold (the planner's table in crds/gguf.py lists the ones it sizes).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from shardwise.crds.gguf import read_header


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]        # numpy order (rows first), i.e. GGUF's dims reversed
    qtype: int
    offset: int                   # absolute file offset of the data
    n_bytes: int


class GGUFIndex:
    """`fields`: the metadata (arrays in full: the tokenizer is built from them); `tensors`: by name."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self.path = path
        header = read_header(path)
        self.version = header.version
        self.fields: dict[str, object] = header.metadata
        self.kv_bytes = header.metadata_span       # where the metadata lies: write_requantized copies it
        self.tensors: dict[str, TensorInfo] = {}
        for t in header.tensors:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
            n_bytes = int(np.prod(t.dims)) // block * type_size
            self.tensors[t.name] = TensorInfo(t.name, tuple(int(d) for d in reversed(t.dims)), t.ggml_type,
                                              t.offset, n_bytes)
        self._map = None

    # ---- data ----
    def data(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor as [rows, bytes per row] (uint8), memory-mapped."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        t = self.tensors[name]
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        return self._map[t.offset:t.offset + t.n_bytes].reshape(rows, -1)


def write_requantized(src: str, dst: str, qtype: str) -> None:
    """Write `src` again as `dst` with its decoder-layer matrices (blk.*, 2-D) quantized to
    `qtype` ("Q8_0", "Q4_0", ...) from their dequantized values; the metadata (tokenizer and all)
    and every other tensor are copied as they are. Makes the Q8_0 and Q4_0 variants of a model
    that the tests and benchmarks/worker_bench.py compare."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    index = GGUFIndex(src)
    target = GGMLQuantizationType[qtype]
    align = int(index.fields.get("general.alignment", 32))
    tensors = []                                    # (name, numpy shape, type, raw bytes)
    for t in index.tensors.values():
        raw, kind = index.data(t.name), GGMLQuantizationType(t.qtype)
        if t.name.startswith("blk.") and len(t.shape) == 2 and kind != target:
            raw, kind = quantize(dequantize(raw, kind).reshape(t.shape), target), target
        tensors.append((t.name, t.shape, kind, np.ascontiguousarray(raw).tobytes()))
    with open(src, "rb") as f:
        f.seek(index.kv_bytes[0])
        kv = f.read(index.kv_bytes[1] - index.kv_bytes[0])
    head = bytearray(b"GGUF" + struct.pack("<IQQ", index.version, len(tensors), len(index.fields)) + kv)
    offset = 0
    for name, shape, kind, raw in tensors:
        encoded = name.encode()
        head += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", len(shape))
        head += b"".join(struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", int(kind), offset)
        offset += -(-len(raw) // align) * align
    with open(dst, "wb") as f:
        f.write(head + bytes(-len(head) % align))
        for _, _, _, raw in tensors:
            f.write(raw + bytes(-len(raw) % align))
