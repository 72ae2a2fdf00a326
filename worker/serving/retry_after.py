"""How long a refused client should wait: Retry-After from the rate at which requests finish.

A 429 for a full waiting queue used to say "1 s" whatever the load, so clients came back at once
and were refused again while the queue drained at its own pace. A place frees in the queue when a
running request finishes and a waiting one takes its row, so the wait for `excess` places is about
excess / (requests finished per second), measured over the last finishes. Clamped to
[MIN_SECONDS, MAX_SECONDS]: never "now", never so long that a client gives up on a server that
merely had a slow minute; with no finish seen yet (a server that just started), MIN_SECONDS.
"""
from __future__ import annotations

import math
from collections import deque

MIN_SECONDS = 1
MAX_SECONDS = 60
WINDOW = 64                 # the finishes the rate is measured over
MAX_AGE_SECONDS = 120.0     # finishes older than this say nothing of the rate now


def retry_after(excess: int, finish_rate: float | None) -> int:
    """Whole seconds until `excess` more places are likely free at `finish_rate` finishes a second."""
    if not finish_rate or finish_rate <= 0 or excess <= 0:
        return MIN_SECONDS
    return max(MIN_SECONDS, min(MAX_SECONDS, math.ceil(excess / finish_rate)))


class FinishRate:
    """Requests finished per second over the last WINDOW finishes (no older than MAX_AGE_SECONDS)."""

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=WINDOW)

    def record(self, at: float) -> None:
        self.times.append(at)

    def per_second(self, now: float) -> float | None:
        """None when fewer than two recent finishes say anything."""
        recent = [t for t in self.times if now - t <= MAX_AGE_SECONDS]
        if len(recent) < 2:
            return None
        # n finishes over the span from the first to now: n - 1 intervals would overstate a rate that
        # has since stopped (the queue stuck behind long requests), so the span runs to `now`.
        span = max(now - recent[0], 1e-3)
        return len(recent) / span

    def retry_after(self, excess: int, now: float) -> int:
        return retry_after(excess, self.per_second(now))
