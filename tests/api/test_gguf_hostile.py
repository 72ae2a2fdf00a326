"""Hostile GGUF files: a header that claims more than its file holds, nests without end or carries
nonsense is one ModelFactsError line naming the file (a GGUFError from the reader), found quickly
and without memory to match the claim - never a traceback, never facts sized from nonsense.
The files are built byte by byte here, so each case is exactly the damage it names."""
from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.crds.gguf import ARRAY, STRING, GGUFError, read_header
from shardwise.crds.modelshape import ModelFacts, ModelFactsError, from_gguf

F32 = 0


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def gguf(kvs: list[bytes] | None = None, tensors: list[tuple[str, tuple[int, ...], int, int]] | None = None,
         data: int | None = None, counts: tuple[int, int] | None = None) -> bytes:
    """A version-3 GGUF file: the metadata pairs, the tensor entries (name, dims, ggml type, offset),
    and `data` bytes of tensor data after the 32-byte aligned header (what the tensors take when None)."""
    kvs = [_kv("general.architecture", STRING, _str("llama")), _u32("llama.block_count", 1),
           _u32("llama.embedding_length", 8), _u32("llama.attention.head_count", 2)] if kvs is None else kvs
    tensors = [("token_embd.weight", (8, 4), F32, 0), ("blk.0.attn_q.weight", (8, 8), F32, 128)] \
        if tensors is None else tensors
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(kvs)
    for name, dims, kind, offset in tensors:
        out += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % 32)
    if data is None:
        data = max((off + 4 * _prod(dims) for _, dims, _, off in tensors), default=0)
    return out + b"\0" * data


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _nested(depth: int) -> bytes:
    """An array of one array of one array ... `depth` deep, ending in an empty array of u8."""
    return struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", 0, 0)


def test_the_crafted_file_reads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf())
    facts = from_gguf(path)
    assert (facts.layers, facts.hidden, facts.params) == (1, 8, 96)


@pytest.mark.parametrize("name,content,says", [
    # old: RecursionError escaped every caller (the operator's model root, `shardwise inspect`)
    ("nested", gguf([_kv("x", ARRAY, _nested(100_000))]), "nest deeper than 4"),
    # old: ZeroDivisionError
    ("align0", gguf([_u32("general.alignment", 0)]), "general.alignment 0 is not a power of two"),
    # old: ValueError from int() outside the reader's errors
    ("alignstr", gguf([_kv("general.alignment", STRING, _str("x"))]), "general.alignment 'x'"),
    # old: facts of 2**64 parameters, sized from dims nothing in the file backs
    ("dims", gguf(tensors=[("token_embd.weight", (1 << 32, 1 << 32), F32, 0)], data=64), "more than the file can hold"),
    # old: accepted, though the data lies past the end of the file (a worker maps past it)
    ("offset", gguf(tensors=[("token_embd.weight", (8, 4), F32, 1 << 40)], data=128), "past the end of the file"),
    ("cut", gguf(data=100), "past the end of the file"),
    # old: the second silently replaced the first
    ("twice", gguf(tensors=[("a", (8,), F32, 0), ("a", (8,), F32, 32)]), "listed twice"),
    ("rank", gguf(tensors=[("a", (1,) * 9, F32, 0)]), "9 dimensions (at most 4)"),
    ("kvcount", gguf(counts=(2, 1 << 62)), "metadata count"),
    ("tensorcount", gguf(counts=(1 << 62, 4)), "tensor count"),
    ("arraycount", gguf([_kv("x", ARRAY, struct.pack("<IQ", STRING, 1 << 60))]), "array count"),
    ("arraytype", gguf([_kv("x", ARRAY, struct.pack("<IQ", 77, 1))]), "unknown value type 77"),
    ("rows", gguf(tensors=[("a", (33,), 2, 0)], data=64), "not whole Q4_0 blocks"),
])
def test_hostile_header_is_one_line_naming_the_file(tmp_path, name, content, says):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFactsError) as e:
        from_gguf(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message, message


def test_inspect_of_a_nested_header_is_one_line(tmp_path):
    """`shardwise inspect` (what a probe pod runs on a tenant's file): exit 2, one line, no traceback."""
    path = tmp_path / "nested.gguf"
    path.write_bytes(gguf([_kv("x", ARRAY, _nested(100_000))]))
    result = subprocess.run([sys.executable, "-m", "shardwise", "inspect", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr and "nest deeper" in result.stderr


def test_a_huge_claimed_array_is_refused_without_reading_it(tmp_path):
    """A 2**60-item array of strings in a 1 KiB file: refused at its count, not read item by item."""
    path = tmp_path / "many.gguf"
    path.write_bytes(gguf([_kv("x", ARRAY, struct.pack("<IQ", ARRAY, 1 << 60))]))
    started = time.monotonic()
    with pytest.raises(GGUFError, match="array count"):
        read_header(path)
    assert time.monotonic() - started < 1


@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8))
@settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_headers_give_facts_or_one_error(tmp_path, edits):
    """Random bytes changed in a valid file: the reader gives a header or GGUFError, from_gguf facts
    or ModelFactsError (one line), never another exception; a header it gives has every tensor
    inside the file."""
    base = bytearray(gguf([_kv("general.architecture", STRING, _str("llama")), _u32("llama.block_count", 1),
                           _u32("llama.embedding_length", 8), _u32("llama.attention.head_count", 2),
                           _u32("general.alignment", 32), _kv("tok", ARRAY, struct.pack("<IQ", STRING, 2)
                                                              + _str("a") + _str("b"))]))
    for at, value in edits:
        base[at % len(base)] = value
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(base))
    try:
        header = read_header(path)
    except GGUFError as e:
        assert "\n" not in str(e)
    else:
        assert all(t.offset <= len(base) for t in header.tensors)
    try:
        assert isinstance(from_gguf(path), ModelFacts)
    except ModelFactsError as e:
        assert "\n" not in str(e) and str(path) in str(e)
