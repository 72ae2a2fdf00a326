"""A slow network link for tests: a TCP relay that paces a real server's answers, so that a download
lasts long enough to be watched (its progress read, a stall seen)."""
from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    """A TCP relay on a loopback port to `upstream` that passes the answers at `rate` bytes per
    second: each connection on its own (a server that limits every stream), or with `shared`, all of
    them together (a node's one link, which parallel streams cannot widen)."""

    def __init__(self, upstream: tuple[str, int], rate: int, shared: bool = False):
        self.upstream, self.rate = upstream, rate
        self.shared = _Timeline() if shared else None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._relay(client, socket.create_connection(self.upstream))

    def _relay(self, client, server) -> None:
        """Start the two directions of one connection: requests as they come, answers paced."""
        threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, self.rate), daemon=True).start()

    def _pipe(self, src, dst, rate) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if rate and self.shared is not None:
                    self.shared.wait(len(data) / rate)
                elif rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


class _Timeline:
    """One link's time: each chunk takes the next free slot of its length, whichever stream sent it."""

    def __init__(self) -> None:
        self.lock, self.free_at = threading.Lock(), 0.0

    def wait(self, seconds: float) -> None:
        with self.lock:
            end = self.free_at = max(self.free_at, time.monotonic()) + seconds
        time.sleep(max(0.0, end - time.monotonic()))
