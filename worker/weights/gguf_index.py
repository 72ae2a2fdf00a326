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
    tensors = []                                    # (name, numpy shape, type, raw bytes)
    for t in index.tensors.values():
        raw, kind = index.data(t.name), GGMLQuantizationType(t.qtype)
        if t.name.startswith("blk.") and len(t.shape) == 2 and kind != target:
            raw, kind = quantize(dequantize(raw, kind).reshape(t.shape), target), target
        tensors.append((t.name, t.shape, kind, np.ascontiguousarray(raw).tobytes()))
    _write(index, src, dst, tensors)


def write_widened(src: str, dst: str, kv_heads: int) -> None:
    """Write `src` (a dense model) again as `dst` with zero attention heads added: `kv_heads`
    key/value heads, each with its group of query heads as before. The added heads' q, k and v rows
    and o columns are zero blocks (a zero scale: every value 0), so the model computes what it did,
    while more tensor-parallel degrees divide its heads: SmolLM2's 9 and 3 heads admit TP 1 and 3,
    12 and 4 admit 2 and 4 too. The tests and benchmarks/gguf_rank_bytes.py run TP 2 on it."""
    index = GGUFIndex(src)
    a = f"{index.fields['general.architecture']}."
    heads = int(index.fields[a + "attention.head_count"])
    kv = int(index.fields.get(a + "attention.head_count_kv") or heads)
    dim = int(index.fields.get(a + "attention.key_length") or index.fields[a + "embedding_length"] // heads)
    extra_kv = (kv_heads - kv) * dim
    extra_q = extra_kv * (heads // kv)
    tensors = []
    for t in index.tensors.values():
        raw, shape = np.asarray(index.data(t.name)), t.shape
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in ("attn_q", "attn_k", "attn_v"):            # rows: the added heads' outputs
            add = extra_q if kind == "attn_q" else extra_kv
            raw, shape = np.concatenate([raw, np.zeros((add, raw.shape[1]), np.uint8)]), (shape[0] + add, shape[1])
        elif kind == "attn_output":                           # columns: whole blocks, the added heads' inputs
            add = extra_q * raw.shape[1] // shape[1]
            raw = np.concatenate([raw, np.zeros((raw.shape[0], add), np.uint8)], axis=1)
            shape = (shape[0], shape[1] + extra_q)
        tensors.append((t.name, shape, t.qtype, np.ascontiguousarray(raw).tobytes()))
    kv_bytes = _kv_section(index, src)
    added = 0
    for key, value in ((a + "attention.head_count", heads + extra_q // dim), (a + "attention.head_count_kv", kv_heads),
                       (a + "attention.key_length", dim), (a + "attention.value_length", dim)):
        if not _set_int(kv_bytes, key, value):
            encoded = key.encode()
            kv_bytes += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<II", 4, value)   # 4: uint32
            added += 1
    _write(index, src, dst, tensors, kv_bytes, len(index.fields) + added)


_INTS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}     # GGUF value type -> struct


def _set_int(kv: bytearray, key: str, value: int) -> bool:
    """Overwrite integer metadata `key` in a raw metadata section; False where it is absent."""
    encoded = key.encode()
    at = kv.find(struct.pack("<Q", len(encoded)) + encoded)
    if at < 0:
        return False
    at += 8 + len(encoded)
    (kind,) = struct.unpack_from("<I", kv, at)
    struct.pack_into("<" + _INTS[kind], kv, at + 4, value)
    return True


def _kv_section(index: GGUFIndex, src: str) -> bytearray:
    with open(src, "rb") as f:
        f.seek(index.kv_bytes[0])
        return bytearray(f.read(index.kv_bytes[1] - index.kv_bytes[0]))


def _write(index: GGUFIndex, src: str, dst: str, tensors: list, kv: bytes | None = None,
           fields: int = 0) -> None:
    """A GGUF file of `tensors` ((name, numpy shape, ggml type, raw bytes)) and the metadata of
    `src` (or the raw section `kv` of `fields` entries)."""
    align = int(index.fields.get("general.alignment", 32))
    kv = _kv_section(index, src) if kv is None else kv
    head = bytearray(b"GGUF" + struct.pack("<IQQ", index.version, len(tensors), fields or len(index.fields)) + kv)
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
