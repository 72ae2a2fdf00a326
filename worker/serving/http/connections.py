"""The HTTP API's connections: accepted and waited on by one thread, served by a bounded pool.

http.server's ThreadingHTTPServer listens with a backlog of 5 (a burst of connections beyond it
is dropped) and gives every connection a thread for as long as it stays open, reading without a
deadline: thousands of idle or byte-a-second clients become thousands of threads. Here one
thread accepts (backlog BACKLOG) and keeps every connection that has no request under way in a
selector; only a connection with bytes to read goes to one of `workers` threads, which serves one
request on it and hands it back (kept alive) or closes it. Every read has a deadline: a request's
line and headers must arrive within Timeouts.headers of its first byte, its body within
Timeouts.body plus its length at Timeouts.body_rate, and a connection idle for Timeouts.idle
closes, as do the oldest idle ones beyond `max_connections`.
"""
from __future__ import annotations

import collections
import math
import queue
import resource
import select
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

BACKLOG = 1024              # connections the kernel queues before they are accepted
WORKERS = 256               # threads serving requests (each holds one while its answer is generated)
MAX_CONNECTIONS = 8192      # open connections; beyond it the oldest idle one is closed
SPARE_WORKERS = 32          # beyond the engine's sequences: /healthz, /metrics, requests refused at once


def workers_for(sequences: int) -> int:
    """Request threads for an engine that holds `sequences` at once, running and waiting: one each
    (a request holds its thread while its answer is generated), so that every request the engine
    would admit reaches it rather than waiting for a thread, plus SPARE_WORKERS; at least WORKERS,
    at most MAX_CONNECTIONS. Threads start as requests come, so an unused bound costs nothing."""
    return min(MAX_CONNECTIONS, max(WORKERS, sequences + SPARE_WORKERS))


@dataclass(frozen=True)
class Timeouts:
    """How long a connection may take over each part of a request, in seconds."""
    idle: float = 10.0          # a connection without a request (new, or kept alive) closes after this
    headers: float = 10.0       # from a request's first byte to the end of its headers
    body: float = 10.0          # a body's deadline: this ...
    body_rate: int = 64 << 10   # ... plus its length at this many bytes a second
    write: float = 30.0         # one write of an answer to a client that does not read it

    def body_deadline(self, n: int) -> float:
        return time.monotonic() + self.body + n / self.body_rate


class DeadlineReader:
    """A request read off its socket, buffered, every wait for bytes bounded by `deadline` (a
    time.monotonic() value): TimeoutError once it has passed. What the handler reads as rfile."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf, self.deadline = sock, bytearray(), math.inf

    @property
    def buffered(self) -> bool:
        """Bytes already read that belong to a request not served yet (pipelining)."""
        return bool(self.buf)

    def _fill(self) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(min(left, 3600.0))
        chunk = self.sock.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self.buf.find(b"\n", 0, limit if limit >= 0 else len(self.buf))
            if end >= 0:
                return self._take(end + 1)
            if 0 <= limit <= len(self.buf) or not self._fill():
                return self._take(len(self.buf) if limit < 0 else min(limit, len(self.buf)))

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        return self._take(len(self.buf) if n < 0 else min(n, len(self.buf)))

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:
        pass


class SocketWriter:
    """The answer written to its socket, each write bounded by `seconds`. The handler's wfile."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.seconds = sock, seconds

    def write(self, data: bytes) -> int:
        self.sock.settimeout(self.seconds)
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def client_gone(sock: socket.socket) -> bool:
    """Whether the client has closed its side of the connection (or reset it), looked at without
    waiting and without taking any byte it sent."""
    # poll first: a recv on a socket with a timeout would wait for bytes whatever its flags
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    events = poller.poll(0)
    if not events:
        return False
    if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class Connection:
    """One accepted connection and what its requests are read from and written to."""

    def __init__(self, sock: socket.socket, address, timeouts: Timeouts):
        self.sock, self.address, self.timeouts = sock, address, timeouts
        self.reader, self.writer = DeadlineReader(sock), SocketWriter(sock, timeouts.write)
        self.handler = None         # made on its first request (the handler keeps its own state)
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class WorkerPool:
    """At most `size` daemon threads running the jobs given, started as the jobs outnumber the
    idle threads. (Not concurrent.futures': its threads are joined at interpreter exit, so a
    request still generating would hold the process up.)"""

    def __init__(self, size: int, name: str = "http"):
        self.size, self.name = size, name
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = self.idle = self.pending = 0
        self.busy = 0                              # jobs running now
        self.quiet = threading.Condition(self.lock)  # notified when busy drops to 0

    def submit(self, fn: Callable, arg) -> None:
        with self.lock:
            self.pending += 1
            if self.pending > self.idle and self.threads < self.size:
                self.threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self.threads}", daemon=True).start()
        self.jobs.put((fn, arg))

    def _work(self) -> None:
        while True:
            with self.lock:
                self.idle += 1
            job = self.jobs.get()
            with self.lock:
                self.idle -= 1
                self.pending -= 1
            if job is None:
                return
            fn, arg = job
            with self.lock:
                self.busy += 1
            try:
                fn(arg)
            finally:
                with self.lock:
                    self.busy -= 1
                    if not self.busy:
                        self.quiet.notify_all()

    def shutdown(self) -> None:
        """Idle threads end; busy ones end after their job."""
        with self.lock:
            count = self.threads
        for _ in range(count):
            self.jobs.put(None)
            with self.lock:
                self.pending += 1

    def wait_quiet(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the running jobs to end; whether none runs."""
        with self.lock:
            return self.quiet.wait_for(lambda: not self.busy, timeout)


# serve(conn) answers one request on `conn` and says whether the connection stays open
ServeOne = Callable[[Connection], bool]


def _within_file_limit(connections: int, workers: int) -> int:
    """`connections` idle ones, or fewer if the process may not open that many files besides the
    ones its workers hold and some for everything else (weights, logs, the ranks' pipes)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(64, min(connections, soft - workers - 256))


class ConnectionServer:
    """Accepts on (host, port) and serves each request with `serve_one` on a pool of threads."""

    def __init__(self, host: str, port: int, serve_one: ServeOne, workers: int = WORKERS,
                 timeouts: Timeouts = Timeouts(), max_connections: int = MAX_CONNECTIONS):
        self.serve_one, self.timeouts = serve_one, timeouts
        self.max_connections = _within_file_limit(max_connections, workers)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((host, port))
            self.listener.listen(BACKLOG)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.address = self.listener.getsockname()
        self.pool = WorkerPool(workers)
        self.selector = selectors.DefaultSelector()
        self.idle: collections.OrderedDict[int, Connection] = collections.OrderedDict()   # oldest first
        self.returned: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.stopping = threading.Event()
        self.stopped = threading.Event()

    # ---- the accepting thread ----
    def serve_forever(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self.stopping.is_set():
                oldest = next(iter(self.idle.values()), None)
                wait = None if oldest is None else max(0.0, oldest.idle_since + self.timeouts.idle - time.monotonic())
                for key, _ in self.selector.select(wait):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._take_back()
                    else:
                        self._dispatch(key.data)
                self._expire()
        finally:
            for conn in list(self.idle.values()):
                self._forget(conn)
                conn.close()
            self.stopped.set()

    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:        # out of file descriptors: what is idle longest makes room
                if not self.idle:       # nothing to close: give the busy ones a moment to end
                    print(f"shardwise serve: accept: {e.strerror}", file=sys.stderr, flush=True)
                    time.sleep(0.05)
                self._close_oldest()
                return
            sock.setblocking(True)
            self._wait_on(Connection(sock, address, self.timeouts))

    def _wait_on(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle[conn.sock.fileno()] = conn
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        while len(self.idle) > self.max_connections:
            self._close_oldest()

    def _forget(self, conn: Connection) -> None:
        self.idle.pop(conn.sock.fileno(), None)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _close_oldest(self) -> None:
        if self.idle:
            conn = next(iter(self.idle.values()))
            self._forget(conn)
            conn.close()

    def _dispatch(self, conn: Connection) -> None:
        self._forget(conn)
        self.pool.submit(self._serve, conn)

    def _take_back(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn = self.returned.get_nowait()
            except queue.Empty:
                return
            if self.stopping.is_set():
                conn.close()
            else:
                self._wait_on(conn)

    def _expire(self) -> None:
        limit = time.monotonic() - self.timeouts.idle
        while self.idle:
            conn = next(iter(self.idle.values()))
            if conn.idle_since > limit:
                return
            self._forget(conn)
            conn.close()

    # ---- the pool's threads ----
    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                keep = self.serve_one(conn) and not self.stopping.is_set()
            except (ConnectionError, TimeoutError):
                keep = False
            except Exception as e:  # noqa: BLE001 - a bug: one line in the log, the connection closed
                print(f"shardwise serve: connection from {conn.address[0]}: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
                keep = False
            if not keep:
                conn.close()
                return
            if not conn.reader.buffered:       # else: the next request is already read, serve it now
                break
        self.returned.put(conn)
        try:
            self.wake_w.send(b"\0")
        except OSError:
            pass

    def shutdown(self) -> None:
        self.stopping.set()
        try:
            self.wake_w.send(b"\0")
        except OSError:
            pass
        self.stopped.wait(10)
        self.pool.shutdown()
        for s in (self.listener, self.wake_r, self.wake_w):
            s.close()
        self.selector.close()
