"""A slow network link for tests: a TCP relay that paces a real server's answers, so that a download
lasts long enough to be watched (its progress read, a stall seen)."""
from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    """A TCP relay on a loopback port to `upstream` that passes the answers at `rate` bytes per
    second (each connection on its own): a slow network link to a real server."""

    def __init__(self, upstream: tuple[str, int], rate: int):
        self.upstream, self.rate = upstream, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.rate), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, rate) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if rate:
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
