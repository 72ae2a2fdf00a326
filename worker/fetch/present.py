"""Which byte ranges of a partly fetched file the node cache holds, and the arithmetic of ranges.

A pipeline stage of a GGUF model needs the file's header and its own tensors' bytes, not the whole
file (select.gguf_stage_ranges). The cache keeps such a file as a *partial* file:

    <entry>/files/<name>                   a sparse file of the file's full size: the store's bytes
                                           inside the recorded ranges, holes elsewhere
    <entry>/.ranges/<hash of the name>     {"name", "size", "checksum", "ranges": [[start, end], ...]}

A whole-file download keeps the same record for its partial copy (`.<name>.partial` beside the
file, renamed into place once verified: cache.py), so a download cut short (the pod killed, the node
rebooted) resumes with the ranges it has. The record names the size and checksum the file was
listed with when it was started: a record started for another size or checksum is not resumed.

The record is what makes a file partial, and the order of writes keeps it true:
- it is created (with no ranges) before the sparse file, so a file without a record is never a
  half-written one: a file in place at its listed size and without a record is whole and verified;
- it is rewritten atomically (temporary file, fsync, rename) only after the bytes of its new ranges
  are fsynced, so a range in the record is always on disk (a range being written is not in it); it
  is rewritten as each part of a fill (and each `min_part_bytes` of a long one) is in, not once the
  fill ends, so a kill loses at most the bytes in flight since (Recorder);
- it is removed once the whole file's checksum matched (the file is then whole), and a file that
  fails is deleted before its record.
Every change happens under the file's exclusive lock in the entry (cache.Entry.file_lock), the lock
whole files are downloaded under, so a reader that checked the record under that lock never reads
a range before it is written.

Nothing in a record is trusted further than it can be checked: a record that does not parse, or
names ranges outside the file, counts as no ranges (they are fetched again).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

Span = tuple[int, int]             # [start, end) in bytes

# A record longer than this is damaged (a stage's ranges are a few per layer).
MAX_RECORD_BYTES = 16 << 20
RECORDS = ".ranges"


def merge(spans: list[Span]) -> list[Span]:
    """The spans sorted, empty ones dropped, overlapping and adjacent ones joined."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


def subtract(want: list[Span], have: list[Span]) -> list[Span]:
    """The parts of `want` not in `have`."""
    out: list[Span] = []
    have = merge(have)
    for start, end in merge(want):
        pos = start
        for h0, h1 in have:
            if h1 <= pos or h0 >= end:
                continue
            if h0 > pos:
                out.append((pos, h0))
            pos = max(pos, h1)
        if pos < end:
            out.append((pos, end))
    return out


def total(spans: list[Span]) -> int:
    return sum(end - start for start, end in merge(spans))


def record_path(entry: Path, name: str) -> Path:
    return entry / RECORDS / hashlib.sha256(name.encode()).hexdigest()[:32]


def read_record(path: Path, size: int, checksum: str | None = None) -> list[Span] | None:
    """The ranges a record says are present (merged); None without a record or with one started for
    another size or (where given) checksum; [] for a damaged one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
        if doc and (doc.get("size") != size or (checksum is not None and doc.get("checksum") != checksum)):
            return None
        spans = [(int(s), int(e)) for s, e in doc["ranges"]] if doc else []
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    if any(not 0 <= s < e <= size for s, e in spans):
        return []
    return merge(spans)


def write_record(path: Path, name: str, size: int, spans: list[Span], checksum: str | None = None) -> None:
    """Replace the record atomically (the ranges' bytes must already be fsynced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        json.dump({"name": name, "size": size, "checksum": checksum,
                   "ranges": [list(s) for s in merge(spans)]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Recorder:
    """The record of one partial file kept as its ranges arrive, from the several part reads of a
    fill at once: `add` fsyncs the file, then rewrites the record with the new range (one at a
    time). The file's lock must be held (cache.Entry.file_lock)."""

    def __init__(self, path: Path, name: str, size: int, checksum: str | None, fd: int, have: list[Span]):
        self.path, self.name, self.size, self.checksum, self.fd = path, name, size, checksum, fd
        self.have = merge(have)
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
        with self._lock:
            if not subtract([span], self.have):
                return
            os.fsync(self.fd)
            self.have = merge(self.have + [span])
            write_record(self.path, self.name, self.size, self.have, self.checksum)


def open_sparse(path: Path, record: Path, name: str, size: int, checksum: str | None) -> list[Span]:
    """The ranges present of the partial file at `path`, to resume; where there is none, or it was
    started for another size or checksum, a new one: its record first, then an empty sparse file of
    `size` bytes (a file is never taken for more than its record says)."""
    have = read_record(record, size, checksum)
    try:
        if have is not None and path.stat().st_size == size:
            return have
    except FileNotFoundError:
        pass
    write_record(record, name, size, [], checksum)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return []


def checksum_tag(checksum) -> str | None:
    """A listed checksum (remote.Checksum) as a record keeps it: 'kind:value'."""
    return None if checksum is None else f"{checksum.kind.value}:{checksum.value}"


def missing_bytes(entry: Path) -> int:
    """Bytes the entry's partial files lack (their holes): what its files' sizes overstate."""
    out = 0
    folder = entry / RECORDS
    if not folder.is_dir():
        return 0
    for path in folder.iterdir():
        if path.name.startswith("."):
            continue
        try:
            doc = json.loads(path.read_bytes()[:MAX_RECORD_BYTES])
            out += max(0, int(doc["size"]) - total([(int(s), int(e)) for s, e in doc["ranges"]]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    return out
