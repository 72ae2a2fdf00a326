"""Per-key rate limits: a token bucket per API key, refilled at `rate` per second up to `burst`.
Pure apart from the clock it is given. A request takes one unit (requests per second) and, once
its answer is known, the bucket is charged its generated tokens when the limit counts tokens."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_KEYS = 4096         # buckets kept (one per key of the key file; the file is bounded by this)


class Unit(str, enum.Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True)
class RateLimit:
    rate: float             # units per second
    burst: float            # bucket size
    unit: Unit

    @classmethod
    def parse(cls, text: str) -> "RateLimit":
        """`RATE/s[:BURST][:tokens|requests]`, e.g. `5/s`, `100/s:400:tokens`. ValueError: one line."""
        parts = text.strip().split(":")
        try:
            if not parts[0].endswith("/s"):
                raise ValueError
            rate = float(parts[0][:-2])
            burst = float(parts[1]) if len(parts) > 1 and parts[1] else max(rate, 1.0)
            unit = Unit(parts[2]) if len(parts) > 2 else Unit.REQUESTS
            if len(parts) > 3 or not (0 < rate <= 1e6 and 1 <= burst <= 1e9 and math.isfinite(rate)):
                raise ValueError
        except ValueError:
            raise ValueError(f"--rate-limit {text!r}: expected RATE/s[:BURST][:requests|tokens] with RATE "
                             f"in (0, 1e6] and BURST in [1, 1e9], e.g. 5/s or 200/s:1000:tokens") from None
        return cls(rate, burst, unit)


class Buckets:
    """One bucket per key index."""

    def __init__(self, limit: RateLimit):
        self.limit = limit
        self._level: dict[int, tuple[float, float]] = {}     # key -> (units left, when)

    def _now_level(self, key: int, now: float) -> float:
        left, when = self._level.get(key, (self.limit.burst, now))
        return min(self.limit.burst, left + (now - when) * self.limit.rate)

    def take(self, key: int, now: float) -> float:
        """0 when the key may send a request now (and a request unit is taken), else the seconds
        until it may (the Retry-After). A token-counted limit lets a request in while the bucket is
        above zero; its tokens are charged afterwards (`charge`)."""
        level = self._now_level(key, now)
        need = 1.0 if self.limit.unit == Unit.REQUESTS else 1e-9
        if level < need:
            self._level[key] = (level, now)
            return (need - level) / self.limit.rate
        if len(self._level) >= MAX_KEYS and key not in self._level:
            self._level.clear()         # bounded: forgetting buckets only lets keys in
        self._level[key] = (level - (need if self.limit.unit == Unit.REQUESTS else 0.0), now)
        return 0.0

    def charge(self, key: int, tokens: int, now: float) -> None:
        """Charge generated tokens to a token-counted bucket (it may go below zero: a debt that
        delays the key's next request)."""
        if self.limit.unit != Unit.TOKENS or tokens <= 0:
            return
        self._level[key] = (self._now_level(key, now) - tokens, now)
