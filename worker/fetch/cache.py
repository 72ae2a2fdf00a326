"""The node-local model cache: files of a remote store kept under a root every pod on the node mounts.

    <root>/entries/<key>/files/<name>    a model's files, as the store names them
    <root>/entries/<key>/entry.json      which (scheme, location, revision) the key stands for
    <root>/entries/<key>/.in-use         shared flock while a process fills or reads the entry
    <root>/entries/<key>/.locks/<hash>   exclusive flock while one process downloads one file (or
                                         ranges of it)
    <root>/entries/<key>/.ranges/<hash>  the byte ranges present of a partial file (present.py)

An entry is keyed by (scheme, location, revision), so a moved tag or rewritten prefix is a new entry
and an old one is never served for it. A file is written under a temporary name in its own folder
and renamed only after its size and checksum match what the store listed: a reader never sees a
partial or corrupt file, and a mismatch deletes it. Two processes filling one entry take the file's
lock in turn; the second finds the first's file in place and does not download it again. Entries are
evicted least recently used under a byte budget, counting the bytes present (a partial file's
ranges, not its sparse size); one in use (its shared lock held) never is.

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
                                           RemoteFile, Unauthorized)
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
_CANCEL_POLL_S = 1.0                       # a read waiting for bytes looks this often whether to stop


class CacheError(WorkerError):
    """The cache could not provide a model's files; one line (never a credential)."""


@dataclass
class FetchReport:
    files_dir: Path                        # where the model's files are, by their store names
    fetched_bytes: int = 0                 # downloaded by this call
    reused_bytes: int = 0                  # already in the cache (or filled by another process)
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
        if need:
            self.cache.make_room(need, keep=self.folder)
        report.reused_bytes = total - need
        tally = Tally(progress, total - need, total)
        tally.add(0)
        with Streams(self.cache.config.streams) as streams:
            fetched = streams.each_file(missing, lambda f: self._fill_one(remote, f, tally, streams))
        report.fetched_bytes = sum(fetched)
        report.reused_bytes += need - report.fetched_bytes
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

    @contextmanager
    def file_lock(self, name: str) -> Iterator[None]:
        """The exclusive lock under which one process writes the file `name` (whole or ranges)."""
        lock = self.folder / ".locks" / hashlib.sha256(name.encode()).hexdigest()[:32]
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)      # a second filler waits here for the first's file
            yield

    def _fill_one(self, remote: Remote, f: RemoteFile, tally: Tally, streams: Streams) -> int:
        """Bytes downloaded for one file: 0 when another process put it in place first."""
        with self.file_lock(f.name):
            if self.whole(f):
                return 0
            target = self.files_dir / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            # A partial copy left by a process killed mid-download (we hold the file's lock, so no
            # live process writes one): its bytes are not trusted, the file is fetched from its start.
            for stale in target.parent.glob(f".{glob.escape(target.name)}.part-*"):
                stale.unlink(missing_ok=True)
            self._download(remote, f, target, tally, streams)
            # a partial copy of it (ranges of a GGUF stage) was replaced whole: no longer partial
            present.record_path(self.folder, f.name).unlink(missing_ok=True)
            return f.size

    def _download(self, remote: Remote, f: RemoteFile, target: Path, tally: Tally, streams: Streams) -> None:
        """The file written at its parts' offsets into a partial copy (its full size from the start),
        checked whole, then renamed into place; the partial copy is deleted whatever happens."""
        cfg = self.cache.config
        tmp = target.with_name(f".{target.name}.part-{os.getpid()}-{threading.get_ident()}")
        what = f"{remote.describe()}/{f.name}"
        parts = plan_parts(f.size, cfg.streams, cfg.min_part_bytes)
        # One stream writes in order: its digest follows the bytes; parts are read back once all in.
        digest = checksums.hasher(f) if len(parts) == 1 else None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, f.size)
                streams.parts([functools.partial(self.fetch_part, remote, f, fd, span, tally, digest,
                                                 streams.cancel) for span in parts])
                os.fsync(fd)
            finally:
                os.close(fd)
            verify_checksum(remote, f, tmp, digest, what)
            os.replace(tmp, target)
        except RemoteError as e:
            raise CacheError(str(e)) from None
        finally:
            tmp.unlink(missing_ok=True)

    def fetch_part(self, remote: Remote, f: RemoteFile, fd: int, span: tuple[int, int], tally: Tally,
                    digest, cancel: threading.Event) -> None:
        """Bytes [start, end) of the file written at their offset; a failed read is retried from
        where it stopped, after a backoff, up to the config's attempts."""
        cfg, (start, end) = self.cache.config, span
        what, pos = f"{remote.describe()}/{f.name}", start
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
                        raise RemoteError(f"{what}: no bytes for {stall_s:.0f}s (stalled)") from None
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
