"""Stopping a server the tests or the local tooling started: SIGTERM, a grace period, then SIGKILL."""
from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, grace_seconds: float) -> None:
    """Ask `proc` to stop, and kill it if it has not exited within `grace_seconds`; returns once it
    has exited (a process already gone is left as it is)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
