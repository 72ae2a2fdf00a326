"""One pipeline stage's share of a GGUF file fetched by byte ranges into the node cache.

A GGUF model is one file; a stage reads its header and its own tensors' data (select.py,
`gguf_stage_ranges`), so its pod fetches only those ranges into a partial file of the cache entry
(a sparse file of the full size plus a record of the ranges present: present.py):

1. Under the file's lock (the one a whole-file download takes, cache.Entry.file_lock) the record is
   read, or created before an empty sparse file of the listed size.
2. The header is read from the start of the file in growing ranges (256 KiB, doubling up to 128 MiB)
   until it parses; it must place every tensor inside the listed size and its last tensor must end
   within one alignment of it, so a store that lies about the size is refused at once.
3. The stage's ranges (the header, its tensors) minus those present are fetched, several reads at
   once and large ranges in parts (streams.py), written at their offsets; each part (and each
   `min_part_bytes` of a long one) is added to the record once fsynced, so a stage killed mid-fill
   keeps what it had written for the next fill. A later stage on the node, or a re-planned stage
   with another share, fetches only the ranges still missing; two stages filling at once take the lock in turn, the second finding
   the first's ranges in place, so neither reads a range before it is written.
4. Once the ranges cover the whole file, the store's whole-file checksum is computed over it: a
   match makes it a whole file (the record removed), a mismatch deletes file and record, in one line.

What a partial file cannot be checked for: a source's checksum covers the whole file, so the bytes of
a range are taken as the store sent them (over TLS for the Hub and registries, and as any store's
bytes are before the whole file's checksum) until the file is complete. What is checked every time:
the header parses and fits the size, each range arrives with exactly its length, the file has the
listed size. See docs/security.md.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

from shardwise.crds.gguf import DEFAULT_ALIGNMENT, GGML_TYPES, GGUFError, Header, read_header
from shardwise.worker.fetch import present
from shardwise.worker.fetch.cache import CacheError, Entry, FetchReport, Progress, safe_name, verify_checksum
from shardwise.worker.fetch.present import Span, merge, subtract, total
from shardwise.worker.fetch.remote import Remote, RemoteError, RemoteFile
from shardwise.worker.fetch.streams import Streams, Tally, plan_parts

# The header is read in ranges from the start: this much first, doubled until it parses, up to the
# last (a 150k-token vocabulary is a few MiB; `shardwise inspect` stops at the same bound).
HEADER_FIRST_BYTES = 256 << 10
HEADER_MAX_BYTES = 128 << 20

# The stage's byte ranges from the file's header (and its path, where the header is in place).
Wants = Callable[[Path, Header], list[Span]]


def fill_gguf_ranges(entry: Entry, remote: Remote, f: RemoteFile, wants: Wants,
                     progress: Progress | None = None) -> FetchReport:
    """The stage's ranges of the GGUF file `f` in `entry` (fetched, or found in place): the report
    counts the ranges' bytes (header and the stage's tensors), not the file's."""
    name = safe_name(f.name)
    target, what = entry.files_dir / name, f"{remote.describe()}/{f.name}"
    report = FetchReport(entry.files_dir, files=[name])
    try:
        with entry.file_lock(name):
            if entry.whole(f):
                share = wants(target, _header(target, what))
                report.reused_bytes = total(share)
            else:
                report.fetched_bytes, report.reused_bytes = _fill(entry, remote, f, wants, progress, what)
    except RemoteError as e:
        raise CacheError(str(e)) from None
    if progress:
        done = report.fetched_bytes + report.reused_bytes
        progress(done, done)
    return report


def partial(entry: Entry, f: RemoteFile) -> bool:
    """Whether the entry holds some ranges of `f` (a partial file)."""
    return present.record_path(entry.folder, f.name).exists()


def _fill(entry: Entry, remote: Remote, f: RemoteFile, wants: Wants, progress: Progress | None,
          what: str) -> tuple[int, int]:
    """(bytes fetched, bytes reused) of the stage's ranges; the file's lock is held."""
    target = entry.files_dir / f.name
    record = present.record_path(entry.folder, f.name)
    have = present.open_sparse(target, record, f.name, f.size, present.checksum_tag(f.checksum))
    with Streams(entry.cache.config.streams) as streams:
        fd = os.open(target, os.O_RDWR)
        try:
            fill = _Ranges(entry, remote, f, fd, record, have, streams)
            header, head_end = fill.header(target, what)
            share = merge([*wants(target, header), (0, head_end)])
            missing = subtract(share, fill.have)
            # the header's bytes fetched just now count as fetched, not as found in the cache
            tally = Tally(progress, total(share) - total(missing) - fill.fetched, total(share))
            tally.add(0)
            tally.add(fill.fetched)
            fill.fetch(missing, tally)
        finally:
            os.close(fd)
    if not subtract([(0, f.size)], fill.have):
        _complete(remote, f, target, record, what)
    return fill.fetched, total(share) - fill.fetched


class _Ranges:
    """Ranges of one partial file written and recorded, under its lock."""

    def __init__(self, entry: Entry, remote: Remote, f: RemoteFile, fd: int, record: Path,
                 have: list[Span], streams: Streams):
        self.entry, self.remote, self.f, self.fd, self.record = entry, remote, f, fd, record
        self.have, self.streams, self.fetched = have, streams, 0

    def fetch(self, spans: list[Span], tally: Tally) -> None:
        """`spans` (none of them present) fetched, each part recorded once fsynced."""
        if not spans:
            return
        cfg, entry = self.entry.cache.config, self.entry
        entry.cache.make_room(total(spans), keep=entry.folder)
        parts = [(s + a, s + b) for s, e in spans for a, b in plan_parts(e - s, cfg.streams, cfg.min_part_bytes)]
        recorder = present.Recorder(self.record, self.f.name, self.f.size,
                                    present.checksum_tag(self.f.checksum), self.fd, self.have)
        self.streams.parts([functools.partial(entry.fetch_part, self.remote, self.f, self.fd, part, tally, None,
                                              self.streams.cancel, recorder.add) for part in parts])
        self.have = recorder.have
        self.fetched += total(spans)

    def header(self, target: Path, what: str) -> tuple[Header, int]:
        """The header, parsed from the file's first bytes (fetched as needed), and where they end;
        a header that does not parse or fit the listed size discards the partial file."""
        step = HEADER_FIRST_BYTES
        while True:
            end = min(step, self.f.size)
            self.fetch(subtract([(0, end)], self.have), Tally(None, 0, 0))
            try:
                header = read_header(target, arrays=False, limit=end)
                _check_size(header, self.f.size, what)
                return header, end
            except GGUFError as e:
                if end < self.f.size and step < HEADER_MAX_BYTES and _short(e):
                    step *= 2                   # a longer header: read on
                    continue
                _discard(target, self.record)
                raise CacheError(f"{what}: {e}; refused, not loaded") from None
            except CacheError:
                _discard(target, self.record)
                raise


def _short(e: GGUFError) -> bool:
    """Whether the header reader stopped at the bytes read so far (crds/gguf.py's words for a header
    longer than its limit), rather than at something wrong in them."""
    return "ends early" in str(e) or "more than the file holds" in str(e)


def _header(path: Path, what: str) -> Header:
    """The header of a whole file in place; CacheError (one line) if it does not parse."""
    try:
        return read_header(path, arrays=False)
    except GGUFError as e:
        raise CacheError(f"{what}: {e}; refused, not loaded") from None


def _check_size(header: Header, size: int, what: str) -> None:
    """CacheError when the header's tensors end more than an alignment before the listed size (a
    size past them is refused by read_header): the store lies about the file's size."""
    align = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    ends = []
    for t in header.tensors:
        if t.ggml_type not in GGML_TYPES:
            return                              # a type not sized here: its end is not known
        _, block_bytes, block_elements = GGML_TYPES[t.ggml_type]
        elements = 1
        for d in t.dims:
            elements *= d
        ends.append(t.offset + elements // block_elements * block_bytes)
    if ends and size - max(ends) >= align:
        raise CacheError(f"{what}: the store lists {size} bytes but the header's tensors end at byte "
                         f"{max(ends)}; refused, not loaded")


def _complete(remote: Remote, f: RemoteFile, target: Path, record: Path, what: str) -> None:
    """Every range in: the whole file checked by the store's checksum, then whole (record removed)."""
    try:
        verify_checksum(remote, f, target, None, what)
    except CacheError:
        _discard(target, record)
        raise
    record.unlink(missing_ok=True)


def _discard(target: Path, record: Path) -> None:
    """A partial file that failed: the file first, then its record (a file without one is whole)."""
    target.unlink(missing_ok=True)
    record.unlink(missing_ok=True)
