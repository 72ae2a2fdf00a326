"""A fetching pod's progress as the operator reads it: the DownloadReport (crds/download.py) kept up to
date from the cache's callbacks, and a small HTTP server answering it at DOWNLOAD_PROGRESS_PATH on the
pod's port while the pod fetches. The model's own server takes the port once the files are in, and
answers the same path with the fetch's final report (`done`, what was fetched and what the cache
held) for as long as the pod runs (worker/cli/pod.py): so the operator reads how a download ended,
and posts its Downloaded Event, however short the download was, without the pod waiting for it.
"""
from __future__ import annotations

import collections
import http.server
import threading
import time

from shardwise.crds import names
from shardwise.crds.download import DownloadReport

RATE_WINDOW_S = 5.0            # the rate is over the last few seconds, not the whole download
_MAX_SAMPLES = 256             # bounded history for the rate, whatever the chunk size


class DownloadTracker:
    """What the cache's callbacks say, turned into a DownloadReport at any moment (thread-safe: the
    server's threads read while the fetching thread writes). A fetch is a few fills (the metadata,
    then the weights the metadata points at): each has its own `phase()` callback, and the report
    is their sum, so the total grows once the weights are known."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._phases: list[list[int]] = []      # [cached, to fetch, fetched] of each fill
        self._retries = 0
        self._done = False
        self._error: str | None = None
        self._last_byte = clock()
        self._samples: collections.deque = collections.deque(maxlen=_MAX_SAMPLES)

    def phase(self):
        """A cache.Progress for one fill: its first call says what the cache already held."""
        mine: list[int] = []

        def progress(done: int, total: int) -> None:
            now = self._clock()
            with self._lock:
                if not mine:
                    mine.extend((done, max(0, total - done), 0))
                    self._phases.append(mine)
                    self._last_byte = now
                else:
                    fetched = min(max(0, done - mine[0]), mine[1])
                    if fetched > mine[2]:
                        self._last_byte = now
                    mine[2] = fetched
                self._samples.append((now, sum(p[2] for p in self._phases)))
        return progress

    def retried(self, reason: str) -> None:
        """cache.Retried: shown in the report until the fetch ends."""
        with self._lock:
            self._retries += 1
            self._error = reason

    def finished(self) -> None:
        with self._lock:
            self._done, self._error = True, None

    def failed(self, reason: str) -> None:
        with self._lock:
            self._error = reason

    def final_body(self) -> bytes:
        """The done report as the port's next server answers it (the fetch has ended: no rate)."""
        return self.report().model_copy(update={"rate": 0.0}).model_dump_json().encode()

    def report(self) -> DownloadReport:
        now = self._clock()
        with self._lock:
            recent = [(t, b) for t, b in self._samples if now - t <= RATE_WINDOW_S]
            rate = 0.0
            if len(recent) >= 2:
                rate = (recent[-1][1] - recent[0][1]) / max(now - recent[0][0], 1e-3)
            return DownloadReport(
                bytes_fetched=sum(p[2] for p in self._phases), bytes_total=sum(p[1] for p in self._phases),
                bytes_cached=sum(p[0] for p in self._phases), rate=max(0.0, rate),
                stalled_seconds=0.0 if self._done else max(0.0, now - self._last_byte),
                retries=self._retries, done=self._done, error=self._error)


class ProgressServer:
    """GET DOWNLOAD_PROGRESS_PATH: the tracker's report as JSON; GET /healthz: 503 (not ready: the
    model is still being fetched); anything else 404. Closed as soon as the fetch ends, before the
    model's server starts."""

    def __init__(self, tracker: DownloadTracker, host: str, port: int):
        handler = _handler(tracker)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _handler(tracker: DownloadTracker):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802 (the stdlib's name)
            if self.path == names.DOWNLOAD_PROGRESS_PATH:
                self._send(200, tracker.report().model_dump_json().encode())
            elif self.path == "/healthz":
                self._send(503, b'{"ready": false, "fetching": true}')
            else:
                self._send(404, b'{"error": "not found"}')

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:   # the operator polls: no line per request
            pass
    return Handler
