"""The download streams of one cache fill: several files fetched at once, and a large file split into
byte-range parts fetched at once, never more than the fill's `streams` reads in flight in all.

Two thread pools: up to `streams` file jobs (each holds its file's lock, writes the file's partial
copy, verifies and renames it) and `streams` part reads, to which the file jobs hand their parts. A
file job only waits on its parts; a part read never waits on a file job, so the pools cannot
deadlock, and the reads in flight are bounded by the part pool alone. The first failure stops the
rest: parts still queued are dropped, parts running stop at their next chunk (or their stall
watchdog, cache.py), and the fill raises that first failure.
"""
from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Optional, TypeVar

from shardwise.crds import names
from shardwise.worker.fetch.remote import MAX_STREAMS

# Reads in flight at once by default (`shardwise fetch --streams`, spec.model.fetchStreams,
# CacheConfig.streams): enough to fill a link that one TCP stream cannot (a long round trip, a
# store's per-connection limit), few enough not to be throttled by the store nor to hold much memory
# (a stream holds up to three READ_CHUNKs in flight).
STREAMS = names.FETCH_STREAMS
# A file is split into parts of at least this many bytes: smaller ones cost a request each for
# little gain.
MIN_PART_BYTES = 16 << 20
# How often a waiting file job or fill looks whether another stream failed.
_POLL_S = 1.0

T = TypeVar("T")
# (bytes done, bytes in all), as cache.Progress
Progress = Callable[[int, int], None]


class Cancelled(Exception):
    """A stream stopped because another of the fill failed (never shown: that failure is)."""


def check_streams(streams: int) -> int:
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be between 1 and {MAX_STREAMS}, not {streams}")
    return streams


def plan_parts(size: int, streams: int, min_part: int = MIN_PART_BYTES) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering a file of `size` bytes: at most `streams` of them, each of at
    least `min_part` bytes (one part for a file smaller than two), none for an empty file."""
    if size <= 0:
        return []
    count = max(1, min(streams, size // max(1, min_part)))
    step = -(-size // count)
    return [(start, min(start + step, size)) for start in range(0, size, step)]


class Tally:
    """Bytes fetched by every stream of a fill, summed under one lock; the progress callback is called
    under it too, so it sees (done, total) in order and needs no lock of its own."""

    def __init__(self, progress: Optional[Progress], done: int, total: int):
        self.progress, self.done, self.total = progress, done, total
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            # a resumed copy that fails its checksum is fetched again whole: never past the total
            self.done = min(self.done + n, max(self.total, self.done))
            if self.progress:
                self.progress(self.done, self.total)


class Streams:
    """The two pools of one fill, as a context manager: `each_file` runs the file jobs, a file job
    runs its parts with `parts`; `cancel` is set once any of them fails."""

    def __init__(self, streams: int):
        check_streams(streams)
        self.cancel = threading.Event()
        self._files = ThreadPoolExecutor(streams, thread_name_prefix="shardwise-fetch-file")
        self._parts = ThreadPoolExecutor(streams, thread_name_prefix="shardwise-fetch-part")

    def __enter__(self) -> "Streams":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel.set()         # an interrupted fill (Ctrl-C) stops its streams at their next chunk
        for pool in (self._files, self._parts):
            pool.shutdown(wait=False, cancel_futures=True)

    def each_file(self, items: list, job: Callable[..., T]) -> list[T]:
        """job(item) for every item, at most `streams` at once; their results in order."""
        return self._gather([self._files.submit(job, item) for item in items])

    def parts(self, reads: list[Callable[[], None]]) -> None:
        """Run a file's part reads in the part pool and wait for all of them."""
        self._gather([self._parts.submit(read) for read in reads])

    def _gather(self, futures: list[Future]) -> list:
        """Wait for every future; once one fails, cancel the queued ones, let the running ones stop
        (each read is bounded by its stall watchdog) and raise the first real failure."""
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
            if self.cancel.is_set() or any(not f.cancelled() and f.exception() for f in done):
                self.cancel.set()
                for f in pending:
                    f.cancel()
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        real = [e for e in errors if not isinstance(e, Cancelled)]
        if real or errors:
            raise (real or errors)[0]
        if any(f.cancelled() for f in futures):
            raise Cancelled()
        return [f.result() for f in futures]
