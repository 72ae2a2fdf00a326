"""A download cut short resumes from the parts it has: a real `shardwise fetch` killed (SIGKILL) mid-way
through a file of several parts, against a real S3 server (MinIO on loopback, behind a paced relay so
the kill lands mid-file), then run again: it fetches only what was missing, the file is whole and
verified, and its line says it resumed. A record started for another file, or a corrupted part, is
never trusted past the whole file's checksum."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from shardwise.e2e.slowlink import SlowLink
from shardwise.worker.fetch import present
from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, Entry, ModelCache, reused_words
from shardwise.worker.fetch.progress import DownloadTracker
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Config, S3Store

MIB = 1 << 20
# a GGUF model of one stage, fetched whole: two parts of 4 MiB (--streams 2, --min-part-mib 1)
SIZE = 8 * MIB
URI = "s3://resume/m"


@pytest.fixture(scope="module")
def body(s3_client) -> bytes:
    s3_client.create_bucket(Bucket="resume")
    data = os.urandom(SIZE)
    s3_client.put_object(Bucket="resume", Key="m/model.gguf", Body=data)
    return data


def command(endpoint: str, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardwise", "fetch", URI, "--cache", str(cache), "--endpoint", endpoint,
            "--path-style", "--streams", "2", "--min-part-mib", "1", *extra]


def record_of(cache: Path) -> Path | None:
    """The ranges record of the partial copy of model.gguf, once there is one."""
    for entry in (cache / "entries").glob("*"):
        path = present.record_path(entry, ".model.gguf.partial")
        if path.exists():
            return path
    return None


def recorded(cache: Path) -> int:
    path = record_of(cache)
    if path is None:
        return 0
    try:
        return present.total([tuple(s) for s in json.loads(path.read_text())["ranges"]])
    except (OSError, ValueError):
        return 0      # caught between its rename and our read: looked at again


class SkewedLink(SlowLink):
    """The paced relay, but an answer to a read from byte 0 passes at full speed: the file's first
    part is in (and recorded) at once, its second crawls at `rate` (4 s), so a kill lands between."""

    def _relay(self, client, server) -> None:
        fast = threading.Event()
        threading.Thread(target=self._up, args=(client, server, fast), daemon=True).start()
        threading.Thread(target=self._down, args=(server, client, fast), daemon=True).start()

    def _up(self, client, server, fast) -> None:
        try:
            while data := client.recv(65536):
                if b"range: bytes=" in data.lower():
                    (fast.set if b"range: bytes=0-" in data.lower() else fast.clear)()
                server.sendall(data)
        except OSError:
            pass

    def _down(self, server, client, fast) -> None:
        try:
            while data := server.recv(65536):
                client.sendall(data)
                if not fast.is_set():
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def killed_fetch(s3_server, cache: Path) -> int:
    """A `shardwise fetch` SIGKILLed once the first of the file's two parts is recorded (the second
    still crawling); the bytes its record holds after the kill."""
    u = urlparse(s3_server.endpoint)
    link = SkewedLink((u.hostname, u.port), rate=MIB)
    at_least = SIZE // 2
    proc = subprocess.Popen(command(f"http://127.0.0.1:{link.port}", cache),
                            env={**os.environ, **s3_server.env()},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None and recorded(cache) < at_least:
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)          # the pod killed mid-download
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        link.close()
    have = recorded(cache)
    assert at_least <= have < SIZE
    return have


def run_again(s3_server, cache: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The same fetch run again at full speed: its output, and its JSON report (a third, no-op run)."""
    out = subprocess.run(command(s3_server.endpoint, cache), env={**os.environ, **s3_server.env()},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = re.search(r"fetched ([\d.]+) MiB, reused ([\d.]+) MiB", out.stdout)
    assert line, out.stdout
    return out, {"fetched": float(line[1]) * MIB, "reused": float(line[2]) * MIB}


def whole_in_place(cache: Path, body: bytes) -> None:
    files = list((cache / "entries").glob("*/files/*"))
    assert [p.name for p in files] == ["model.gguf"], files       # no partial copy left beside it
    assert hashlib.md5(files[0].read_bytes()).digest() == hashlib.md5(body).digest()
    assert not list((cache / "entries").glob("*/.ranges/*"))


def test_a_killed_fetch_resumes_fetching_only_what_was_missing(s3_server, body, tmp_path):
    have = killed_fetch(s3_server, tmp_path)
    out, report = run_again(s3_server, tmp_path)
    assert have == SIZE // 2                           # the first part; nothing of the second
    assert (report["fetched"], report["reused"]) == (SIZE - have, have), out.stdout
    assert f"({have / MIB:.1f} MiB resumed from a download cut short)" in out.stdout, out.stdout
    whole_in_place(tmp_path, body)
    again, _ = run_again(s3_server, tmp_path)         # whole now: nothing fetched, nothing "resumed"
    assert "fetched 0.0 MiB" in again.stdout and "MiB resumed" not in again.stdout


@pytest.mark.parametrize("field, value", [("size", SIZE + 1), ("checksum", "md5:" + "0" * 32)])
def test_a_record_started_for_another_file_is_not_resumed(s3_server, body, tmp_path, field, value):
    killed_fetch(s3_server, tmp_path)
    path = record_of(tmp_path)
    doc = json.loads(path.read_text())
    doc[field] = value                   # the partial copy was started for another size or checksum
    path.write_text(json.dumps(doc))
    out, report = run_again(s3_server, tmp_path)
    assert (report["fetched"], report["reused"]) == (SIZE, 0) and "MiB resumed" not in out.stdout, out.stdout
    whole_in_place(tmp_path, body)


def test_a_corrupted_resumed_part_fails_the_checksum_and_the_file_is_fetched_whole(s3_server, body, tmp_path):
    killed_fetch(s3_server, tmp_path)
    at = json.loads(record_of(tmp_path).read_text())["ranges"][0][0] + 1000
    copy = next((tmp_path / "entries").glob("*/files/.model.gguf.partial"))
    with open(copy, "r+b") as f:          # a recorded byte flipped on disk
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    out, report = run_again(s3_server, tmp_path)
    assert "md5 checksum does not match" in out.stderr, out.stderr
    assert "fetching it whole again" in out.stderr, out.stderr
    assert report["fetched"] == SIZE and "MiB resumed" not in out.stdout, out.stdout
    whole_in_place(tmp_path, body)


def test_a_stale_partial_copy_nobody_fills_is_reclaimed_when_the_cache_needs_room(s3_server, body, tmp_path):
    have = killed_fetch(s3_server, tmp_path)
    cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0))
    [(entry, held, _)] = cache.usage()
    assert held == have                     # the budget counts the bytes the copy holds
    cache.make_room(1, keep=entry)
    assert record_of(tmp_path) is not None  # a copy a day old or younger is kept for its next fetch
    old = time.time() - 2 * 24 * 3600
    os.utime(record_of(tmp_path), (old, old))
    with Entry(cache, entry).file_lock("model.gguf"):     # being filled by another process: kept
        subprocess.run([sys.executable, "-c", RECLAIM, str(tmp_path)], check=True, timeout=60)
    assert record_of(tmp_path) is not None
    cache.make_room(1, keep=entry)
    assert record_of(tmp_path) is None and not list(entry.glob("files/.*.partial"))
    assert cache.usage()[0][1] == 0


RECLAIM = """
import sys
from pathlib import Path
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
ModelCache(CacheConfig(Path(sys.argv[1]), 1 << 34, disk_reserve_bytes=0)).make_room(1, keep=None)
"""


def test_a_pods_progress_counts_resumed_bytes_as_cached_not_fetched(s3_server, body, tmp_path):
    have = killed_fetch(s3_server, tmp_path)
    tracker = DownloadTracker()
    config = S3Config(endpoint=s3_server.endpoint, path_style=True)
    remote = S3Store(parse_model_uri(URI), config, s3_server.env())
    cache = ModelCache(CacheConfig(tmp_path, 1 << 34, disk_reserve_bytes=0, streams=2, min_part_bytes=MIB))
    report = fetch_stage(cache, remote, "s3", "resume/m", progress=tracker.phase())
    status = tracker.report()          # what the operator shows in status.download
    assert (status.bytes_cached, status.bytes_fetched, status.bytes_total) == (have, SIZE - have, SIZE - have)
    assert (report.fetched_bytes, report.reused_bytes, report.resumed_bytes) == (SIZE - have, have, have)
    assert "(4.0 MiB resumed from a download cut short)" in reused_words(report)
