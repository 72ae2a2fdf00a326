"""A fast reader of a GGUF file's metadata and tensor index, with tensor data memory-mapped.

`gguf.GGUFReader` turns every vocabulary string into its own numpy array, which takes seconds for
a 50k-token vocabulary; every rank opens the file, so this reader parses the header with plain
`struct` and leaves dequantization to the `gguf` package.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]        # numpy order (rows first), i.e. GGUF's dims reversed
    qtype: int
    offset: int                   # absolute file offset of the data
    n_bytes: int


class GGUFIndex:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.buf = f.read(16 << 20)   # metadata lives at the start; grown below if needed
        self.pos = 0
        if self.buf[:4] != b"GGUF":
            raise GGUFFormatError("not a GGUF file")
        self.pos = 4
        self.version = self._u32()
        n_tensors, n_kv = self._u64(), self._u64()
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._str()
            self.fields[key] = self._value(self._u32())
        self.kv_bytes = (24, self.pos)       # where the metadata lies: write_requantized copies it
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = [self._u64() for _ in range(self._u32())]
            qtype, off = self._u32(), self._u64()
            infos.append((name, dims, qtype, off))
        align = int(self.fields.get("general.alignment", 32))
        data_start = (self.pos + align - 1) // align * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, off in infos:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            n_bytes = int(np.prod(dims)) // block * type_size
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype,
                                            data_start + off, n_bytes)
        self._map = None

    # ---- header parsing ----
    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            if n > (1 << 32):
                raise GGUFFormatError("corrupt header")
            with open(self.path, "rb") as f:
                self.buf = f.read(max(len(self.buf) * 2, self.pos + n))
            if self.pos + n > len(self.buf):
                raise GGUFFormatError("file ends inside its header")

    def _unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self._need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def _u32(self) -> int:
        return self._unpack("<I")

    def _u64(self) -> int:
        return self._unpack("<Q")

    def _str(self) -> str:
        n = self._u64()
        self._need(n)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._str()
        if vtype == _ARRAY:
            itype, count = self._u32(), self._u64()
            if itype == _STRING:
                return [self._str() for _ in range(count)]
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype])
                self._need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        raise GGUFFormatError(f"unknown value type {vtype}")

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
