"""The node-local model cache: files of a remote store kept under a root every pod on the node mounts.

    <root>/entries/<key>/files/<name>    a model's files, as the store names them
    <root>/entries/<key>/entry.json      which (scheme, location, revision) the key stands for
    <root>/entries/<key>/.in-use         shared flock while a process fills or reads the entry
    <root>/entries/<key>/.locks/<hash>   exclusive flock while one process downloads one file (or
                                         ranges of it)
    <root>/entries/<key>/.ranges/<hash>  the byte ranges present of a partial file (present.py)
    <root>/entries/<key>/files/.<name>.partial   a whole-file download under way (or cut short)

An entry is keyed by (scheme, location, revision), so a moved tag or rewritten prefix is a new entry
and an old one is never served for it. A file is written as `.<name>.partial` in its own folder
and renamed only after its size and checksum match what the store listed: a reader never sees a
partial or corrupt file, and a mismatch deletes it. The partial copy keeps a ranges record
(present.py) rewritten as each part's bytes are fsynced, so a download cut short (the process
killed, the node rebooted) resumes with the parts it has: the next fill of the file fetches only the
missing ranges, unless the record was started for another size or checksum (then it starts over).
A resumed file is verified exactly like a fresh one; one that fails is deleted and fetched whole
once more. A partial copy that has not grown for PARTIAL_MAX_AGE_S, with no process filling it, is
deleted when the cache needs room. Two processes filling one entry take the file's lock in turn;
the second finds the first's file in place (or the first's partial copy, which it resumes). Entries
are evicted least recently used under a byte budget, counting the bytes present (a partial file's
or copy's recorded ranges, not its sparse size); one in use (its shared lock held) never is.

A GGUF model's pipeline stage fetches only the header and its tensors' byte ranges into a partial
file (gguf_fill.py; the record of what is present: present.py); that file is whole, and verified by
the store's checksum, once every range is in. A file with a record is never taken as whole here.
"""
from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
import queue
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch import checksums, present
from shardwise.worker.fetch.remote import (MAX_NAME_BYTES, NotFound, Remote, RemoteError,
                                           RemoteFile, Unauthorized, Unreachable)
from shardwise.worker.fetch.streams import MIN_PART_BYTES, STREAMS, Cancelled, Streams, Tally, plan_parts

# (bytes done, bytes in all), reused bytes counted as done; called once before any byte is fetched
# (done = what the cache already held), then as bytes arrive
Progress = Callable[[int, int], None]
Retried = Callable[[str], None]            # a read failed and is retried: its one-line reason

# Free space kept on the cache's disk beyond what a download needs (logs, other pods' scratch).
DISK_RESERVE_BYTES = 1 << 30
# A read that yields nothing for this long is stalled: abandoned and retried.
STALL_TIMEOUT_S = 120.0
ATTEMPTS = 4                               # tries of one file (the first and three retries)
BACKOFF_S = (1.0, 4.0, 15.0)               # waits between them
# A download's partial copy that has not grown for this long, and that no process is filling, is
# deleted when the cache needs room (a file of an old layout nobody resumes).
PARTIAL_MAX_AGE_S = 24 * 3600.0
_CANCEL_POLL_S = 1.0                       # a read waiting for bytes looks this often whether to stop


class CacheError(WorkerError):
    """The cache could not provide a model's files; one line (never a credential)."""


@dataclass
class FetchReport:
    files_dir: Path                        # where the model's files are, by their store names
    fetched_bytes: int = 0                 # downloaded by this call
    reused_bytes: int = 0                  # already in the cache (or filled by another process)
    resumed_bytes: int = 0                 # of reused_bytes: in partial copies of downloads cut short
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CacheConfig:
    root: Path
    budget_bytes: int                      # all entries together stay under this
    disk_reserve_bytes: int = DISK_RESERVE_BYTES
    stall_timeout_s: float = STALL_TIMEOUT_S
    attempts: int = ATTEMPTS
    backoff_s: tuple[float, ...] = BACKOFF_S
    streams: int = STREAMS                 # reads in flight at once (files and parts of a file)
    min_part_bytes: int = MIN_PART_BYTES   # a file is split into parts no smaller than this
    partial_max_age_s: float = PARTIAL_MAX_AGE_S


def entry_key(scheme: str, location: str, revision: str) -> str:
    return hashlib.sha256(f"{scheme}\0{location}\0{revision}".encode()).hexdigest()[:32]


def safe_name(name: str) -> str:
    """A store's file name as a path under the entry: relative, no '.', '..' or empty segment."""
    if not name or len(name.encode()) > MAX_NAME_BYTES or "\0" in name or "\\" in name:
        raise CacheError(f"refusing file name {name[:80]!r} from the store (empty, too long or odd)")
    if name.startswith("/") or any(seg in ("", ".", "..") for seg in name.split("/")):
        raise CacheError(f"refusing file name {name[:80]!r} from the store (absolute or with '..')")
    return name


class ModelCache:
    def __init__(self, config: CacheConfig, on_retry: Retried | None = None):
        self.config, self.on_retry = config, on_retry
        self.entries = Path(config.root) / "entries"
        self.entries.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def open(self, scheme: str, location: str, revision: str) -> Iterator["Entry"]:
        """The entry, held in use (never evicted) until the block ends."""
        key = entry_key(scheme, location, revision)
        folder = self.entries / key
        while True:   # an evictor may delete the folder between our mkdir and our lock: try again
            try:
                (folder / ".locks").mkdir(parents=True, exist_ok=True)
                fd = os.open(folder / ".in-use", os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.fstat(fd).st_ino == os.stat(folder / ".in-use").st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            meta = folder / "entry.json"
            if not meta.exists():
                _write_atomic(meta, json.dumps({"scheme": scheme, "location": location,
                                                "revision": revision}).encode())
            os.utime(meta)     # least recently used is by this stamp
            yield Entry(self, folder)
        finally:
            os.close(fd)

    def fetch(self, remote: Remote, scheme: str, location: str, files: list[RemoteFile],
              progress: Progress | None = None) -> FetchReport:
        """Fetch `files` of `remote` into their entry (at the remote's revision) and return the report;
        the entry is no longer held in use afterwards (see `open` to hold it)."""
        with self.open(scheme, location, remote.revision()) as entry:
            return entry.fill(remote, files, progress)

    def usage(self) -> list[tuple[Path, int, float]]:
        """(entry folder, bytes of its files, last used) of every entry."""
        out = []
        for folder in self.entries.iterdir():
            try:
                used = (folder / "entry.json").stat().st_mtime
            except FileNotFoundError:
                used = 0.0
            held = max(0, _tree_bytes(folder / "files") - present.missing_bytes(folder))
            out.append((folder, held, used))
        return out

    def make_room(self, need: int, keep: Path) -> None:
        """Evict least recently used entries not in use until `need` more bytes fit the budget and
        the disk; CacheError (one line) when they cannot."""
        cfg = self.config
        for folder in list(self.entries.iterdir()):
            Entry(self, folder).reclaim_stale_copies(cfg.partial_max_age_s)
        entries = sorted(self.usage(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        for folder, size, _ in entries:
            if total + need <= cfg.budget_bytes and self._free() >= need + cfg.disk_reserve_bytes:
                break
            if folder != keep and _evict(folder):
                total -= size
        if total + need > cfg.budget_bytes:
            raise CacheError(f"the node cache's budget of {_gib(cfg.budget_bytes)} cannot hold "
                             f"{_gib(need)} more (entries in use hold {_gib(total)})")
        free = self._free()
        if free < need + cfg.disk_reserve_bytes:
            raise CacheError(f"the disk under {cfg.root} has {_gib(free)} free; the model's files "
                             f"need {_gib(need)} more (plus {_gib(cfg.disk_reserve_bytes)} kept free)")

    def _free(self) -> int:
        return shutil.disk_usage(self.entries).free


class Entry:
    def __init__(self, cache: ModelCache, folder: Path):
        self.cache, self.folder, self.files_dir = cache, folder, folder / "files"

    def fill(self, remote: Remote, files: list[RemoteFile], progress: Progress | None = None) -> FetchReport:
        """Fetch the files not yet in place, several at once and large ones in parts (streams.py)."""
        report = FetchReport(self.files_dir, files=[safe_name(f.name) for f in files])
        total = sum(f.size for f in files)
        missing = [f for f in files if not self.whole(f)]
        need = sum(f.size for f in missing)
        resumable = sum(self.resumable(f) for f in missing)    # already counted in the cache's usage
        if need > resumable:
            self.cache.make_room(need - resumable, keep=self.folder)
        tally = Tally(progress, total - need + resumable, total)
        tally.add(0)
        with Streams(self.cache.config.streams) as streams:
            done = streams.each_file(missing, lambda f: self._fill_one(remote, f, tally, streams))
        report.fetched_bytes = sum(fetched for fetched, _ in done)
        report.resumed_bytes = sum(resumed for _, resumed in done)
        report.reused_bytes = total - report.fetched_bytes
        if progress:
            progress(total, total)
        return report

    def whole(self, f: RemoteFile) -> bool:
        """Whether `f` is in place whole (a partial file, which has a ranges record, is not)."""
        try:
            if (self.files_dir / safe_name(f.name)).stat().st_size != f.size:
                return False
        except FileNotFoundError:
            return False
        return not present.record_path(self.folder, f.name).exists()

    def partial_path(self, name: str) -> tuple[Path, Path]:
        """(the partial copy of a whole-file download of `name`, its ranges record)."""
        target = self.files_dir / name
        copy = target.with_name(f".{target.name}.partial")
        return copy, present.record_path(self.folder, self._copy_name(copy))

    def _copy_name(self, copy: Path) -> str:
        """A partial copy's name in its record: its path under the files folder."""
        return copy.relative_to(self.files_dir).as_posix()

    def resumable(self, f: RemoteFile) -> int:
        """Bytes of `f` a download cut short left in its partial copy, as a fill would resume them."""
        copy, record = self.partial_path(safe_name(f.name))
        have = present.read_record(record, f.size, present.checksum_tag(f.checksum))
        try:
            return present.total(have or []) if copy.stat().st_size == f.size else 0
        except FileNotFoundError:
            return 0

    @contextmanager
    def file_lock(self, name: str, wait: bool = True) -> Iterator[bool]:
        """The exclusive lock under which one process writes the file `name` (whole or ranges);
        with `wait=False`, yields False at once when another process holds it."""
        lock = self.folder / ".locks" / hashlib.sha256(name.encode()).hexdigest()[:32]
        with open(lock, "a") as held:
            try:      # a second filler waits here for the first's file
                fcntl.flock(held, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True

    def reclaim_stale_copies(self, max_age_s: float) -> None:
        """Delete the partial copies of whole-file downloads whose record has not changed for
        `max_age_s` and whose file no process is filling (its lock free); an entry being evicted
        meanwhile is left to the evictor."""
        try:
            records = list((self.folder / present.RECORDS).iterdir())
        except FileNotFoundError:
            return
        for record in records:
            try:
                name = json.loads(record.read_bytes()[:present.MAX_RECORD_BYTES])["name"]
                stale = time.time() - record.stat().st_mtime > max_age_s
            except (OSError, ValueError, TypeError, KeyError):
                continue
            folder, _, base = str(name).rpartition("/")
            if not (stale and base.startswith(".") and base.endswith(".partial")):
                continue            # a GGUF stage's partial file is kept: its ranges are its share
            original = f"{folder}/{base[1:-len('.partial')]}".lstrip("/")
            try:
                with self.file_lock(original, wait=False) as mine:
                    if mine and present.record_path(self.folder, name) == record:
                        (self.files_dir / safe_name(name)).unlink(missing_ok=True)
                        record.unlink(missing_ok=True)
            except (OSError, CacheError):
                continue

    def _fill_one(self, remote: Remote, f: RemoteFile, tally: Tally, streams: Streams) -> tuple[int, int]:
        """(bytes downloaded, bytes resumed) for one file: (0, 0) when another process put it in
        place first."""
        with self.file_lock(f.name):
            copy, record = self.partial_path(f.name)
            if self.whole(f):
                record.unlink(missing_ok=True)    # a record left by a kill just after the rename
                return 0, 0
            target = self.files_dir / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            # per-process copies written by earlier versions of the cache: never resumed
            for stale in target.parent.glob(f".{glob.escape(target.name)}.part-*"):
                stale.unlink(missing_ok=True)
            try:
                try:
                    resumed = self._download(remote, f, tally, streams)
                except _ResumedMismatch as e:
                    # the bytes kept from before did not make the listed file: it is fetched whole
                    if self.cache.on_retry:
                        self.cache.on_retry(f"{e}; fetching it whole again")
                    resumed = self._download(remote, f, tally, streams)
            except RemoteError as e:
                raise CacheError(str(e)) from None
            os.replace(copy, target)
            # the record of the partial copy, and of a partial file it replaced (ranges of a GGUF stage)
            record.unlink(missing_ok=True)
            present.record_path(self.folder, f.name).unlink(missing_ok=True)
            return f.size - resumed, resumed

    def _download(self, remote: Remote, f: RemoteFile, tally: Tally, streams: Streams) -> int:
        """The file's missing ranges written at their offsets into its partial copy (its full size
        from the start), each part recorded once fsynced, then the whole copy checked; the bytes it
        resumed. A copy that fails the check is deleted (with its record)."""
        cfg = self.cache.config
        copy, record = self.partial_path(f.name)
        what = f"{remote.describe()}/{f.name}"
        tag = present.checksum_tag(f.checksum)
        have = present.open_sparse(copy, record, self._copy_name(copy), f.size, tag)
        missing = present.subtract([(0, f.size)], have)
        parts = [(s + a, s + b) for s, e in missing
                 for a, b in plan_parts(e - s, cfg.streams, cfg.min_part_bytes)]
        # One stream writing the file in order: its digest follows the bytes; otherwise read back.
        digest = checksums.hasher(f) if parts == [(0, f.size)] else None
        fd = os.open(copy, os.O_WRONLY)
        try:
            recorder = present.Recorder(record, self._copy_name(copy), f.size, tag, fd, have)
            streams.parts([functools.partial(self.fetch_part, remote, f, fd, span, tally, digest,
                                             streams.cancel, recorder.add) for span in parts])
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            verify_checksum(remote, f, copy, digest, what)
        except CacheError as e:
            copy.unlink(missing_ok=True)
            record.unlink(missing_ok=True)
            if have:
                raise _ResumedMismatch(str(e)) from None
            raise
        return present.total(have)

    def fetch_part(self, remote: Remote, f: RemoteFile, fd: int, span: tuple[int, int], tally: Tally,
                   digest, cancel: threading.Event,
                   record: Callable[[tuple[int, int]], None] | None = None) -> None:
        """Bytes [start, end) of the file written at their offset; a failed read is retried from
        where it stopped, after a backoff, up to the config's attempts. `record` is given the bytes
        written so far every `min_part_bytes` of them and once all are in (it fsyncs and records)."""
        cfg, (start, end) = self.cache.config, span
        what, pos = f"{remote.describe()}/{f.name}", start
        every, recorded = max(1, cfg.min_part_bytes), start
        for attempt in range(cfg.attempts):
            try:
                chunks = remote.read(f.name, pos, None if end == f.size else end)
                for chunk in _stall_bounded(chunks, cfg.stall_timeout_s, what, cancel):
                    if cancel.is_set():
                        raise Cancelled()
                    if pos + len(chunk) > end:
                        raise CacheError(f"{what}: the store sent more than the {f.size} bytes it listed")
                    _write_at(fd, chunk, pos)
                    if digest:
                        digest.update(chunk)
                    pos += len(chunk)
                    tally.add(len(chunk))
                    if record and pos - recorded >= every:
                        record((start, pos))
                        recorded = pos
                break
            except (NotFound, Unauthorized):
                raise
            except RemoteError as e:
                if cancel.is_set():
                    raise Cancelled() from None
                if attempt + 1 >= cfg.attempts:
                    raise CacheError(f"{e} (gave up after {cfg.attempts} tries)") from None
                if self.cache.on_retry:
                    self.cache.on_retry(str(e))
                cancel.wait(cfg.backoff_s[min(attempt, len(cfg.backoff_s) - 1)])
        if pos != end:
            raise CacheError(f"{what}: received {pos - start} bytes of [{start}, {end}), the store "
                             f"listed {f.size} in all; not kept")
        if record:
            record((start, end))


class _ResumedMismatch(CacheError):
    """A download that resumed a partial copy failed the whole file's checksum (the copy is gone)."""


def reused_words(report: FetchReport) -> str:
    """'reused X MiB' of a report, with how much of it a download cut short had left
    ('X MiB resumed'), so a resumed download reads differently from a fresh one."""
    mib = 1 << 20
    words = f"reused {report.reused_bytes / mib:.1f} MiB"
    if report.resumed_bytes:
        words += f" ({report.resumed_bytes / mib:.1f} MiB resumed from a download cut short)"
    return words


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def verify_checksum(remote: Remote, f: RemoteFile, path: Path, digest, what: str) -> None:
    got = checksums.computed(remote, f, path, digest)
    if got is not None and got != f.checksum.value:   # type: ignore[union-attr]
        raise CacheError(f"{what}: {f.checksum.kind.value} checksum does not match the store's "  # type: ignore[union-attr]
                         f"({got[:12]}… != {f.checksum.value[:12]}…); deleted, not loaded")  # type: ignore[union-attr]


def _stall_bounded(chunks: Iterator[bytes], stall_s: float, what: str,
                   cancel: threading.Event | None = None) -> Iterator[bytes]:
    """The chunks of a read, read in a thread so a read that yields nothing for `stall_s` raises
    (the thread is left to the store's own socket timeout; its chunks are dropped), and one whose
    fill was cancelled (another stream failed) stops within a second."""
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def pump() -> None:
        try:
            for c in chunks:
                if stop.is_set():
                    return
                q.put(("chunk", c))
            q.put(("end", None))
        except BaseException as e:   # handed to the reader, which raises it
            q.put(("error", e))
        finally:   # the read's connection is released by the thread that drives it
            close = getattr(chunks, "close", None)
            if close:
                close()

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            deadline = time.monotonic() + stall_s
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                try:
                    kind, value = q.get(timeout=max(0.0, min(_CANCEL_POLL_S, deadline - time.monotonic())))
                    break
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        raise Unreachable(f"{what}: no bytes for {stall_s:.0f}s (stalled)") from None
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        try:   # unblock a pump waiting on a full queue
            q.get_nowait()
        except queue.Empty:
            pass


def _evict(folder: Path) -> bool:
    """Delete an entry unless some process holds it in use; whether it was deleted."""
    try:
        fd = os.open(folder / ".in-use", os.O_RDWR)
    except FileNotFoundError:
        shutil.rmtree(folder, ignore_errors=True)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:   # the lock file goes first: a process opening the entry now sees it is gone and retries
        os.unlink(folder / ".in-use")
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _tree_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
