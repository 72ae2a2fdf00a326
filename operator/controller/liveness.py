"""Liveness of the reconcile loops, for /healthz: each model's loop records when it last completed a
pass (or started); a loop that has not completed one for STALL_SECONDS is stalled (a pass stuck in
a call that never returns, a starved event loop), and /healthz then fails so the kubelet restarts
the operator. Loops wait at most a few tens of seconds between passes (STEADY_REQUEUE, the
back-off), so a healthy loop completes one far more often than that."""
from __future__ import annotations

import threading
import time

STALL_SECONDS = 300.0


class Liveness:
    def __init__(self, stall_seconds: float = STALL_SECONDS) -> None:
        self.stall_seconds = stall_seconds
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def completed(self, key: tuple[str, str], now: float | None = None) -> None:
        """A pass of `key`'s loop completed (or its loop started)."""
        with self._lock:
            self._last[key] = time.monotonic() if now is None else now

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._last.pop(key, None)

    def stalled(self, now: float | None = None) -> list[str]:
        """"namespace/name" of each loop that has not completed a pass for stall_seconds."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return sorted(f"{ns}/{name}" for (ns, name), at in self._last.items() if now - at > self.stall_seconds)
