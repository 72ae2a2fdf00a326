"""The autoscaler's decision, pure: how many replicas a serving model should run, from what its
replicas reported (operator/controller/autoscaler.py reads them and acts), and why.

The rule is the HPA's: desired = ceil(replicas x observed / target), left alone within 10% of the
target, clamped to [minReplicas, maxReplicas]. The observed value is per replica, and a replica that
did not report (starting, or not answering) counts as idle, so a scale-up does not count twice the
load that the replicas it already added have not taken yet. Around it:

- up: after scaleUpStabilizationSeconds of load above target (0: at once);
- down (to zero included): only once every replica reports, after scaleDownDelaySeconds of load
  below target measured that way, and not while a replica to remove (the highest numbered ones,
  which the reconciler removes first) still runs or queues requests, unless that has lasted the
  drain grace too: its pod's own drain on SIGTERM then finishes them;
- to zero only when no replica runs or queues anything, and with minReplicas 0;
- from zero: nothing runs to report load, so requests held at the model's router with no replica
  (`held`, its shardwise_router_held_requests gauge) wake it; without a router, a wake is a manual
  scale (`kubectl scale --replicas=1`), which the autoscaler then keeps for scaleDownDelaySeconds
  at least.

The times the delays count from are kept in status.autoscaling (aboveSince, belowSince), so a
restarted operator goes on where the last one was.
"""
from __future__ import annotations

import dataclasses
import math
from datetime import datetime
from typing import Iterable, Mapping, Optional

from shardwise.crds.autoscaling import Autoscaling, AutoscalingTarget, ScaleReason
from shardwise.operator.decide import recovery

TOLERANCE = 0.1     # |observed/target - 1| within this: no change (the HPA's default)
QUANTILE = 0.9


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """What one replica's stage-0 pod reported (already clamped to sane bounds by the reader).
    `ttft_buckets`: its time-to-first-token histogram over the last period, as cumulative
    (upper bound in seconds, count) pairs, +inf last."""

    waiting: float = 0.0
    running: float = 0.0
    kv_cache: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0


@dataclasses.dataclass(frozen=True)
class Memory:
    """The autoscaler's times, from status.autoscaling."""

    last_scale: Optional[datetime] = None
    above_since: Optional[datetime] = None
    below_since: Optional[datetime] = None

    @classmethod
    def from_status(cls, status: Optional[Mapping]) -> "Memory":
        status = status or {}
        return cls(*(_time(status.get(k)) for k in ("lastScaleTime", "aboveSince", "belowSince")))


def _time(value: object) -> Optional[datetime]:
    """A time status.autoscaling holds; None for anything else (status is writable by others)."""
    try:
        return recovery.parse_iso(value) if isinstance(value, str) else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Verdict:
    desired: int
    reason: ScaleReason
    observed: Optional[float]
    memory: Memory

    @property
    def scales(self) -> bool:
        return self.reason in SCALING

    def status(self, target: float) -> dict:
        """status.autoscaling."""
        m = self.memory
        return {"desiredReplicas": self.desired, "reason": self.reason.value,
                "observedValue": None if self.observed is None else round(self.observed, 4),
                "targetValue": target, "lastScaleTime": recovery.iso(m.last_scale) if m.last_scale else None,
                "aboveSince": recovery.iso(m.above_since) if m.above_since else None,
                "belowSince": recovery.iso(m.below_since) if m.below_since else None}


SCALING = frozenset({ScaleReason.SCALED_UP, ScaleReason.SCALED_DOWN, ScaleReason.SCALED_TO_ZERO,
                     ScaleReason.RAISED_TO_MIN, ScaleReason.LOWERED_TO_MAX})


def quantile(buckets: Iterable[tuple[float, float]], q: float = QUANTILE) -> Optional[float]:
    """The q-quantile of cumulative histogram buckets (Prometheus's histogram_quantile: linear within
    the bucket; the highest finite bound when it falls in +inf); None without observations."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, low, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * ((rank - below) / (count - below) if count > below else 1.0)
        low, below = bound, count
    return low


def merged(loads: Iterable[ReplicaLoad]) -> list[tuple[float, float]]:
    """The replicas' histograms summed bucket by bucket."""
    total: dict[float, float] = {}
    for load in loads:
        for bound, count in load.ttft_buckets:
            total[bound] = total.get(bound, 0.0) + count
    return sorted(total.items())


def observe(loads: Mapping[int, ReplicaLoad], replicas: int, target: AutoscalingTarget) -> Optional[float]:
    """The target's value per replica; a replica that did not report counts as idle. None: nothing
    to go by (no replica reported; for TTFT: no request started in the period)."""
    if not loads:
        return None
    if target == AutoscalingTarget.TTFT_P90:
        return quantile(merged(loads.values()))
    field = "waiting" if target == AutoscalingTarget.QUEUE_DEPTH else "kv_cache"
    return sum(getattr(load, field) for load in loads.values()) / max(replicas, len(loads), 1)


def _clamp(n: int, spec: Autoscaling) -> int:
    return max(spec.min_replicas, min(spec.max_replicas, n))


def decide(loads: Mapping[int, ReplicaLoad], replicas: int, spec: Autoscaling, memory: Memory,
           now: datetime, drain_grace: float, held: int = 0) -> Verdict:
    """The replicas `replicas` should become, from `loads` (replica -> what it reported; those that
    did not report are missing), and why. `drain_grace`: seconds a removed replica's pod has to
    finish its streams; `held`: requests waiting at the model's front door with no replica."""
    loads = {r: load for r, load in loads.items() if 0 <= r < replicas}    # a removed one still draining: not counted
    busy = held > 0 or any(not load.idle for load in loads.values())
    observed = observe(loads, replicas, spec.target)
    if replicas < spec.min_replicas or replicas > spec.max_replicas:
        reason = ScaleReason.RAISED_TO_MIN if replicas < spec.min_replicas else ScaleReason.LOWERED_TO_MAX
        return Verdict(_clamp(replicas, spec), reason, observed, Memory(now))
    if replicas == 0:
        if held > 0:
            return Verdict(_clamp(1, spec), ScaleReason.SCALED_UP, observed, Memory(now))
        return Verdict(0, ScaleReason.IDLE, None, Memory(memory.last_scale))
    if not loads:
        return Verdict(replicas, ScaleReason.NO_METRICS, None, Memory(memory.last_scale))
    ratio = (observed / spec.value) if observed is not None else (1.0 if busy else 0.0)
    raw = replicas if abs(ratio - 1.0) <= TOLERANCE else math.ceil(replicas * ratio - 1e-9)
    desired = _clamp(max(raw, 1) if busy else raw, spec)
    if desired > replicas:
        return _up(desired, replicas, spec, memory, now, observed)
    if desired < replicas:
        return _down(desired, replicas, loads, spec, memory, now, observed, drain_grace)
    reason = ScaleReason.AT_MAXIMUM if raw > replicas else ScaleReason.WITHIN_TARGET
    return Verdict(replicas, reason, observed, Memory(memory.last_scale))


def _up(desired: int, replicas: int, spec: Autoscaling, memory: Memory, now: datetime,
        observed: Optional[float]) -> Verdict:
    since = memory.above_since or now
    if (now - since).total_seconds() < spec.scale_up_stabilization_seconds:
        return Verdict(replicas, ScaleReason.STABILIZING, observed, Memory(memory.last_scale, above_since=since))
    return Verdict(desired, ScaleReason.SCALED_UP, observed, Memory(now))


def _down(desired: int, replicas: int, loads: Mapping[int, ReplicaLoad], spec: Autoscaling, memory: Memory,
          now: datetime, observed: Optional[float], drain_grace: float) -> Verdict:
    if any(r not in loads for r in range(replicas)):
        # A replica still starting counts as idle: its load is not known, so nothing is removed.
        return Verdict(replicas, ScaleReason.NO_METRICS, observed, Memory(memory.last_scale))
    since = memory.below_since or now
    low = (now - since).total_seconds()
    keep = Memory(memory.last_scale, below_since=since)
    if low < spec.scale_down_delay_seconds:
        return Verdict(replicas, ScaleReason.DELAYED, observed, keep)
    removed = [loads[r] for r in range(desired, replicas)]
    if any(not load.idle for load in removed) and low < spec.scale_down_delay_seconds + drain_grace:
        return Verdict(replicas, ScaleReason.DRAINING, observed, keep)
    reason = ScaleReason.SCALED_TO_ZERO if desired == 0 else ScaleReason.SCALED_DOWN
    return Verdict(desired, reason, observed, Memory(now))


def message(verdict: Verdict, replicas: int, spec: Autoscaling, held: int = 0) -> str:
    """The Event's message for a change of replicas: one line."""
    if replicas == 0 and held > 0:
        return (f"replicas 0 -> {verdict.desired}: {held} request{'s' if held > 1 else ''} held at the router "
                f"({spec.min_replicas}-{spec.max_replicas} replicas)")
    seen = "no value" if verdict.observed is None else f"{verdict.observed:.3g}"
    return (f"replicas {replicas} -> {verdict.desired}: {spec.target.value} {seen} per replica, "
            f"target {spec.value:g} ({spec.min_replicas}-{spec.max_replicas} replicas)")
