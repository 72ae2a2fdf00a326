"""A download that stalls halfway is abandoned in bounded time and retried, resuming where it stopped:
a real TCP proxy in front of the real S3 server stops forwarding one object's bytes midway."""
from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

import pytest

from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.s3 import S3Config, S3Store

VICTIM = "model-00003-of-00006.safetensors"


class StallingProxy:
    """Forwards loopback connections to the S3 server; the first `stalls` responses to a GET of
    VICTIM stop after `cut` bytes and send nothing more (the connection stays open)."""

    def __init__(self, upstream: str, cut: int, stalls: int):
        u = urlparse(upstream)
        self.upstream, self.cut, self.stalls = (u.hostname, u.port), cut, stalls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop, self.sockets, self.lock = threading.Event(), [], threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            stalling = threading.Event()
            threading.Thread(target=self._up, args=(client, server, stalling), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, stalling), daemon=True).start()

    def _up(self, client, server, stalling) -> None:
        while data := _recv(client):
            if f"/{VICTIM}".encode() in data and data.startswith(b"GET"):
                with self.lock:
                    if self.stalls > 0:
                        self.stalls -= 1
                        stalling.set()
            server.sendall(data)

    def _down(self, server, client, stalling) -> None:
        sent = 0
        while data := _recv(server):
            if stalling.is_set():
                data = data[:max(0, self.cut - sent)]
                sent += len(data)
                if not data:
                    self.stop.wait()      # stall: the client hears nothing more
                    return
            client.sendall(data)

    def close(self) -> None:
        self.stop.set()
        for s in [self.listener, *self.sockets]:
            s.close()


def _recv(sock) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


@pytest.mark.parametrize("who_notices", ["client read timeout", "cache stall watchdog"])
def test_a_stalled_download_is_retried_and_resumed(s3_server, s3_model, sharded_model, tmp_path, who_notices):
    proxy = StallingProxy(s3_server.endpoint, cut=20_000, stalls=2)
    try:
        client_timeout, stall = (1, 60.0) if who_notices == "client read timeout" else (60, 1.0)
        config = S3Config(endpoint=proxy.endpoint, path_style=True, read_timeout_s=client_timeout, attempts=1)
        remote = S3Store(parse_model_uri("s3://models/tiny"), config, s3_server.env())
        victim = next(f for f in remote.list_files() if f.name == VICTIM)
        cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0, stall_timeout_s=stall,
                                       attempts=3, backoff_s=(0.1,)))
        with cache.open("s3", "models/tiny", remote.revision()) as entry:
            report = entry.fill(remote, [victim])
        assert report.fetched_bytes == victim.size and proxy.stalls == 0   # two stalls, then whole
        assert (report.files_dir / VICTIM).read_bytes() == (sharded_model / VICTIM).read_bytes()

        # Stalls beyond the tries: one line, nothing kept.
        proxy.stalls = 5
        with cache.open("s3", "models/tiny", "another-revision") as entry:
            with pytest.raises(CacheError) as e:
                entry.fill(remote, [victim])
        message = str(e.value)
        assert VICTIM in message and "gave up after 3 tries" in message and "\n" not in message
        assert ("timed out" in message) if who_notices == "client read timeout" else ("stalled" in message)
        assert not (entry.files_dir / VICTIM).exists()
    finally:
        proxy.close()
