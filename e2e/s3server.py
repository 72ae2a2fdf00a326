"""A real S3 server for the tests and the benchmark: MinIO, built from its Go module into its own keyed
folder of the build cache, started on loopback with a temporary data folder and random credentials.

The folder is keyed by a hash of this module's pin alone (not the Kubernetes set's), so changing the
S3 server's pin never rebuilds the control plane's binaries, and an unchanged pin is reused at once.

    python -m shardwise.e2e.s3server          # build (once) and print the binary's path
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from shardwise.e2e import processes
from shardwise.e2e.build import BuildError, cache_root, run_with_progress, _check_go, _go_env

# MinIO publishes no semantic versions to the Go proxy: a pinned commit's pseudo-version.
MINIO_MODULE = "github.com/minio/minio"
MINIO = "v0.0.0-20260212201848-7aac2a2c5b7c"
# Bounds: a server that is not answering its health probe in this long is reported, not waited on.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def s3_bin_dir() -> Path:
    digest = hashlib.sha256(f"{MINIO_MODULE}@{MINIO}".encode()).hexdigest()[:12]
    return cache_root() / "s3server" / digest


def minio_path() -> Path:
    return s3_bin_dir() / "minio"


def build_s3_server(say=print) -> Path:
    """Build MinIO once (a lock keeps two test sessions from building it twice); its path."""
    target = s3_bin_dir()
    if os.access(target / "minio", os.X_OK):
        return target / "minio"
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(target / "minio", os.X_OK):
            return target / "minio"
        _check_go()
        log_path = target.parent / "build.log"
        say(f"building MinIO {MINIO} into {target} (log: {log_path}); several minutes on two cores")
        t0 = time.monotonic()
        with open(log_path, "a") as log, tempfile.TemporaryDirectory(dir=target) as out:
            env = {**_go_env(target), "GOBIN": out, "GOFLAGS": "-buildvcs=false"}
            cmd = ["go", "install", "-trimpath", "-ldflags", "-s -w", f"{MINIO_MODULE}@{MINIO}"]
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            rc = run_with_progress(cmd, None, env, log, "minio", say)
            if rc != 0:
                raise BuildError(f"[minio] go install failed (exit {rc}); see {log_path}")
            os.replace(Path(out) / "minio", target / "minio")
        say(f"[minio] done in {time.monotonic() - t0:.0f}s")
    return target / "minio"


@dataclass(frozen=True)
class S3Server:
    """A running server: where it listens and the credentials it accepts."""
    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The environment variables a pod gets from its credentials Secret."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(endpoint: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BuildError(f"minio exited with {proc.returncode} at start; see {log_path}")
        try:
            with urllib.request.urlopen(endpoint + "/minio/health/live", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise BuildError(f"minio did not answer on {endpoint} within {START_TIMEOUT_S:.0f}s; see {log_path}")


@contextlib.contextmanager
def running_s3_server(data_dir: Path, say=print) -> Iterator[S3Server]:
    """MinIO on a loopback port serving `data_dir`, with fresh random credentials; stopped on exit."""
    binary = build_s3_server(say)
    port, console = _free_port(), _free_port()
    server = S3Server(endpoint=f"http://127.0.0.1:{port}", access_key="sw" + secrets.token_hex(8),
                      secret_key=secrets.token_urlsafe(24))
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "minio.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINIO_", "AWS_"))}
    env.update(MINIO_ROOT_USER=server.access_key, MINIO_ROOT_PASSWORD=server.secret_key,
               MINIO_BROWSER="off", MINIO_UPDATE="off", CI="true")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(binary), "server", "--quiet", "--address", f"127.0.0.1:{port}",
                                 "--console-address", f"127.0.0.1:{console}", str(data_dir / "data")],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server.endpoint, proc, log_path)
        yield server
    finally:
        processes.stop(proc, STOP_TIMEOUT_S)


if __name__ == "__main__":
    try:
        print(build_s3_server())
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
