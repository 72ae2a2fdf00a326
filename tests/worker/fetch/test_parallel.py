"""Parallel downloads from a real S3 server (MinIO on loopback, behind e2e/slowlink.py's paced relay
where concurrency must be seen): several files at once and a large file in byte-range parts, progress
summed across streams, an interrupted pull resumed by whole files and recorded parts, a failing part
never putting its file in place."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest

from shardwise.crds.modelsource import parse_model_uri
from shardwise.e2e.slowlink import SlowLink
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.s3 import S3Config, S3Store
from shardwise.worker.fetch.streams import plan_parts

MIB = 1 << 20
# name -> size: two files split into parts (1 MiB parts at least), a small one and an empty one
FILES = {"a.bin": 6 * MIB, "b.bin": 3 * MIB + 12345, "config.json": 700, "empty.json": 0}


class Watched:
    """The real store, its reads recorded: the (name, start, end) asked and the most in flight."""

    def __init__(self, remote):
        self.remote, self.asked, self.now, self.peak = remote, [], 0, 0
        self.lock = threading.Lock()

    def describe(self):
        return self.remote.describe()

    def revision(self):
        return self.remote.revision()

    def list_files(self):
        return self.remote.list_files()

    def read(self, name, start=0, end=None):
        with self.lock:
            self.asked.append((name, start, end))

        def reading():
            with self.lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            try:
                yield from self.remote.read(name, start, end)
            finally:
                with self.lock:
                    self.now -= 1
        return reading()


@pytest.fixture(scope="module")
def bucket(s3_client) -> dict[str, bytes]:
    s3_client.create_bucket(Bucket="parallel")
    contents = {name: os.urandom(size) for name, size in FILES.items()}
    for name, body in contents.items():
        s3_client.put_object(Bucket="parallel", Key=f"m/{name}", Body=body)
    return contents


def slow_store(s3_server, link: SlowLink, attempts: int = 2) -> S3Store:
    config = S3Config(endpoint=f"http://127.0.0.1:{link.port}", path_style=True, read_timeout_s=10,
                      attempts=attempts)
    return S3Store(parse_model_uri("s3://parallel/m"), config, s3_server.env())


def upstream(s3_server) -> tuple[str, int]:
    u = urlparse(s3_server.endpoint)
    return u.hostname, u.port


def test_files_and_parts_are_fetched_at_once_byte_identical_with_progress_summed(s3_server, bucket, tmp_path):
    link = SlowLink(upstream(s3_server), rate=16 * MIB)      # per connection: streams add up
    try:
        remote = Watched(slow_store(s3_server, link))
        cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0, streams=4,
                                       min_part_bytes=MIB))
        seen = []
        report = cache.fetch(remote, "s3", "parallel/m", remote.list_files(),
                             progress=lambda d, t: seen.append((d, t)))
    finally:
        link.close()
    assert {p.name: p.read_bytes() for p in report.files_dir.iterdir()} == bucket
    assert not list(tmp_path.rglob(".*.partial"))
    whole = sum(FILES.values())
    assert (report.fetched_bytes, report.reused_bytes) == (whole, 0)
    # a.bin in 4 parts of 1.5 MiB, b.bin in 3; the small file whole; the empty one never read
    asked = {n: sorted((s, e) for name, s, e in remote.asked if name == n) for n in FILES}
    assert asked["a.bin"] == [(s, None if e == FILES["a.bin"] else e) for s, e in plan_parts(6 * MIB, 4, MIB)]
    assert len(asked["a.bin"]) == 4 and len(asked["b.bin"]) == 3
    assert asked["config.json"] == [(0, None)] and asked["empty.json"] == []
    assert 2 <= remote.peak <= 4
    # progress: from 0 to the whole, never backwards, every byte of every stream counted once
    assert seen[0] == (0, whole) and seen[-1] == (whole, whole)
    assert all(t == whole for _, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    steps = [b[0] - a[0] for a, b in zip(seen, seen[1:]) if b[0] > a[0]]
    parts = [e - s for n in ("a.bin", "b.bin") for s, e in plan_parts(FILES[n], 4, MIB)]
    assert sorted(steps) == sorted(parts + [FILES["config.json"]])    # each part's chunk counted once


PULL = """
import sys
from pathlib import Path
from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.s3 import S3Config, S3Store
endpoint, root = sys.argv[1], sys.argv[2]
remote = S3Store(parse_model_uri("s3://parallel/m"), S3Config(endpoint=endpoint, path_style=True))
cache = ModelCache(CacheConfig(Path(root), 1 << 34, disk_reserve_bytes=0, streams=2, min_part_bytes=1 << 20))
cache.fetch(remote, "s3", "parallel/m", remote.list_files())
"""


def test_an_interrupted_pull_resumes_without_fetching_the_files_it_completed(s3_server, bucket, tmp_path):
    # 2 MiB/s per stream, 2 streams: a.bin's two parts take ~1.5 s, then b.bin's ~0.8 s
    link = SlowLink(upstream(s3_server), rate=2 * MIB)
    env = {**os.environ, **s3_server.env()}
    proc = subprocess.Popen([sys.executable, "-c", PULL, f"http://127.0.0.1:{link.port}", str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def in_place() -> set[str]:
        return {p.name for p in tmp_path.glob("entries/*/files/[!.]*") if p.stat().st_size}

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and not (
                in_place() and list(tmp_path.rglob(".*.partial"))):
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)      # the pod killed mid-download: one file in, one partial
        proc.wait(timeout=10)
        completed = in_place()
        partial = list(tmp_path.rglob(".*.partial"))
        assert completed and partial and len(completed) < 3, proc.stderr.read()[-2000:]
        remote = Watched(slow_store(s3_server, link))
        cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0, streams=2, min_part_bytes=MIB))
        report = cache.fetch(remote, "s3", "parallel/m", remote.list_files())
    finally:
        if proc.poll() is None:
            proc.kill()
        link.close()
    kept = sum(FILES[n] for n in completed)
    # the completed files are reused whole; the partial one's recorded parts are resumed
    assert report.fetched_bytes + report.reused_bytes == sum(FILES.values())
    assert report.reused_bytes == kept + report.resumed_bytes
    assert not {name for name, _, _ in remote.asked} & completed
    assert {p.name: p.read_bytes() for p in report.files_dir.iterdir()} == bucket
    assert not list(tmp_path.rglob(".*.partial"))     # the killed process's partial copy is in place now


class CuttingLink(SlowLink):
    """The slow link, but the answer to the first GET asking a.bin from byte `start` (on whichever
    connection, a kept-alive one included) is cut after `cut` bytes, the connection closed: one part
    failing mid-way."""

    def __init__(self, upstream, rate, start: int, cut: int):
        super().__init__(upstream, rate)
        self.start, self.cut, self.cuts, self.lock = start, cut, 1, threading.Lock()

    def _relay(self, client, server) -> None:
        cutting = threading.Event()
        threading.Thread(target=self._up, args=(client, server, cutting), daemon=True).start()
        threading.Thread(target=self._down, args=(server, client, cutting), daemon=True).start()

    def _up(self, client, server, cutting) -> None:
        try:
            while data := client.recv(65536):
                if b"/a.bin" in data and f"bytes={self.start}-".encode() in data:
                    with self.lock:
                        if self.cuts:
                            self.cuts -= 1
                            cutting.set()
                server.sendall(data)
        except OSError:
            pass

    def _down(self, server, client, cutting) -> None:
        sent = 0
        try:
            while data := server.recv(65536):
                if cutting.is_set():
                    data = data[:self.cut - sent]
                    sent += len(data)
                client.sendall(data)
                time.sleep(len(data) / self.rate)
                if cutting.is_set() and sent >= self.cut:
                    break
        except OSError:
            pass
        for s in (client, server):     # the answer ends short: the client sees the connection close
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_a_part_failing_midway_fails_the_file_in_one_line_and_never_puts_it_in_place(s3_server, bucket, tmp_path):
    third = plan_parts(FILES["a.bin"], 4, MIB)[2][0]
    link = CuttingLink(upstream(s3_server), rate=4 * MIB, start=third, cut=300_000)
    try:
        remote = slow_store(s3_server, link, attempts=1)
        cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0, streams=4, min_part_bytes=MIB,
                                       attempts=1))
        with pytest.raises(CacheError) as e:
            cache.fetch(remote, "s3", "parallel/m", remote.list_files())
    finally:
        link.close()
    message = str(e.value)
    assert message.startswith("s3://parallel/m/a.bin") and "\n" not in message, message
    in_place = [p for p in tmp_path.glob("entries/*/files/*") if not p.name.startswith(".")]
    assert "a.bin" not in {p.name for p in in_place}
    for p in in_place:        # whatever else is in place is whole
        assert p.read_bytes() == bucket[p.name]
