"""The process supervisor: a container as a process of its own group, started with its command,
stopped with SIGTERM then SIGKILL after the grace period, and the termination message it leaves."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from shardwise.e2e.localcluster.localnodes.timestamps import now

MAX_BACKOFF = 10.0  # restart back-off cap in seconds (a kubelet's is 5 minutes)
TERMINATION_LOG = "/dev/termination-log"
MESSAGE_BYTES = 4096        # a kubelet keeps at most this much of a termination message
FALLBACK_LOG_LINES = 80     # ... and of the log's tail in its place (FallbackToLogsOnError)


class ContainerProc:
    """One container: its process, restarts and probe state; its files are in the pod's folder."""

    def __init__(self, spec: dict, folder: Path):
        self.spec = spec
        self.name = spec["name"]
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.restarts = 0
        self.ready = False
        self.last_terminated: dict | None = None
        self.terminated: dict | None = None
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.next_start = 0.0
        self.probe_due = 0.0
        self.live_due = 0.0
        self.ready_ok = 0
        self.ready_fail = 0
        self.live_fail = 0

    @property
    def log_file(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def message_file(self) -> Path:
        """Where the container's terminationMessagePath points."""
        return self.folder / f"{self.name}.termination-log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> dict:
        if self.running():
            return {"running": {"startedAt": self.started_at}}
        if self.terminated:
            return {"terminated": self.terminated}
        reason, message = self.waiting or ("ContainerCreating", "")
        return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def start(c: ContainerProc, command: list[str], env: dict[str, str], cwd: str) -> None:
    """Run the container's process in a session of its own, its output appended to its log; a
    command that cannot start counts as a failed start (RunContainerError, restarted with back-off)."""
    out = open(c.log_file, "ab")
    out.write(f"--- {now()} start {command!r}\n".encode())
    out.flush()
    try:
        c.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        c.waiting = ("RunContainerError", f"{type(e).__name__}: {e}")
        c.last_terminated = {"exitCode": 128, "reason": "StartError", "message": str(e),
                             "finishedAt": now()}
        c.restarts += 1
        c.next_start = time.monotonic() + min(MAX_BACKOFF, 0.5 * 2 ** c.restarts)
        return
    finally:
        out.close()
    c.started_at = now()
    c.waiting = None
    delay = (c.spec.get("readinessProbe") or {}).get("initialDelaySeconds", 0)
    c.probe_due = time.monotonic() + delay
    c.live_due = time.monotonic() + (c.spec.get("livenessProbe") or {}).get(
        "initialDelaySeconds", 0)


def kill(c: ContainerProc, grace: float) -> None:
    """SIGTERM to the container's process group, SIGKILL after `grace` seconds."""
    proc = c.proc
    if proc is None or proc.poll() is not None:
        return
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_all(containers: list[ContainerProc], grace: float) -> None:
    """Stop every running container of a pod within one grace period; each is left terminated."""
    procs = [c for c in containers if c.proc is not None]
    for c in procs:
        if c.proc.poll() is None:
            signal_group(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in procs:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_group(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        if c.terminated is None:
            c.terminated = {"exitCode": 137 if c.proc.returncode < 0 else c.proc.returncode,
                            "reason": "Killed" if c.proc.returncode < 0 else "Completed",
                            "startedAt": c.started_at, "finishedAt": now(),
                            **termination_message(c, c.proc.returncode)}
        c.proc = None
        c.ready = False


def termination_message(c: ContainerProc, code: int) -> dict:
    """{"message": ...} as a kubelet reports it: the file the container wrote, else (policy
    FallbackToLogsOnError, the container failed) the tail of its log; {} when there is none."""
    try:
        text = c.message_file.read_bytes()[:MESSAGE_BYTES].decode(errors="replace")
    except OSError:
        text = ""
    if not text.strip() and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        try:
            lines = c.log_file.read_bytes().decode(errors="replace").splitlines()
        except OSError:
            lines = []
        text = "\n".join(lines[-FALLBACK_LOG_LINES:])[-MESSAGE_BYTES // 2:]
    return {"message": text} if text.strip() else {}


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
