"""The autoscaler's decision (operator/decide/autoscaling.py), pure: a table of what the replicas
reported, the replicas and the times so far, and what it must decide and why."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from shardwise.crds.autoscaling import Autoscaling, ScaleReason as R
from shardwise.operator.decide.autoscaling import Memory, ReplicaLoad, decide, message, quantile

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
GRACE = 10.0


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def q(*waiting: float, running: float = 1) -> dict[int, ReplicaLoad]:
    """Replicas 0.. reporting these queue depths (and `running` requests each)."""
    return {r: ReplicaLoad(waiting=w, running=running) for r, w in enumerate(waiting)}


IDLE = {r: ReplicaLoad() for r in range(3)}
QUEUE = Autoscaling(minReplicas=1, maxReplicas=4, targetValue=4, scaleDownDelaySeconds=60)
ZERO = Autoscaling(minReplicas=0, maxReplicas=4, targetValue=4, scaleDownDelaySeconds=60)
STABLE = Autoscaling(minReplicas=1, maxReplicas=4, targetValue=4, scaleUpStabilizationSeconds=30)
KV = Autoscaling(minReplicas=1, maxReplicas=8, target="kvCacheUtilization", targetValue=0.5)
TTFT = Autoscaling(minReplicas=1, maxReplicas=8, target="ttftP90Seconds", targetValue=1)
BUCKETS = ((0.5, 10.0), (1.0, 20.0), (2.5, 100.0), (float("inf"), 100.0))   # p90 = 1 + 1.5 * 70/80


CASES = {
    # name: (spec, loads, replicas, memory, desired, reason)
    "queue above target adds replicas at once": (QUEUE, q(12), 1, Memory(), 3, R.SCALED_UP),
    "the rule is ceil(replicas x observed / target)": (QUEUE, q(6, 6), 2, Memory(), 3, R.SCALED_UP),
    "never beyond maxReplicas": (QUEUE, q(40), 1, Memory(), 4, R.SCALED_UP),
    "at maxReplicas it says so": (QUEUE, q(40, 40, 40, 40), 4, Memory(), 4, R.AT_MAXIMUM),
    "within 10% of target: no change": (QUEUE, q(4.3, 4.3), 2, Memory(), 2, R.WITHIN_TARGET),
    "replicas still starting count as idle (no double counting)": (QUEUE, q(12), 3, Memory(), 3, R.WITHIN_TARGET),
    "up waits for the stabilisation": (STABLE, q(12), 1, Memory(above_since=ago(10)), 1, R.STABILIZING),
    "up after the stabilisation": (STABLE, q(12), 1, Memory(above_since=ago(31)), 3, R.SCALED_UP),
    "low load starts the delay": (QUEUE, q(0, 0, 0, running=0), 3, Memory(), 3, R.DELAYED),
    "low load before the delay ends: held": (QUEUE, q(0, 0, 0, running=0), 3, Memory(below_since=ago(59)), 3,
                                              R.DELAYED),
    "after the delay: down, to min when idle": (QUEUE, IDLE, 3, Memory(below_since=ago(61)), 1, R.SCALED_DOWN),
    "down only as far as the load asks": (QUEUE, {0: ReplicaLoad(waiting=3, running=1), 1: ReplicaLoad(),
                                                  2: ReplicaLoad()}, 3, Memory(below_since=ago(61)), 1,
                                          R.SCALED_DOWN),
    "a replica not reporting blocks a scale-down": (QUEUE, {0: ReplicaLoad(), 1: ReplicaLoad()}, 3,
                                                    Memory(below_since=ago(600)), 3, R.NO_METRICS),
    "a replica to remove with streams is waited for": (QUEUE, {0: ReplicaLoad(), 1: ReplicaLoad(running=2)}, 2,
                                                       Memory(below_since=ago(65)), 1, None),
    "but not beyond its drain grace": (QUEUE, {0: ReplicaLoad(), 1: ReplicaLoad(running=2)}, 2,
                                       Memory(below_since=ago(61 + GRACE)), 1, R.SCALED_DOWN),
    "idle with minReplicas 0: to zero after the delay": (ZERO, {0: ReplicaLoad()}, 1, Memory(below_since=ago(61)),
                                                         0, R.SCALED_TO_ZERO),
    "a running stream keeps one replica": (ZERO, {0: ReplicaLoad(running=1)}, 1, Memory(below_since=ago(600)), 1,
                                           R.WITHIN_TARGET),
    "at zero and nothing held: idle": (ZERO, {}, 0, Memory(), 0, R.IDLE),
    "below minReplicas: raised at once": (QUEUE, {}, 0, Memory(), 1, R.RAISED_TO_MIN),
    "above maxReplicas (kubectl scale): lowered at once": (QUEUE, q(0), 6, Memory(), 4, R.LOWERED_TO_MAX),
    "no replica reported: nothing done": (QUEUE, {}, 2, Memory(), 2, R.NO_METRICS),
    "kv-cache use per replica": (KV, {0: ReplicaLoad(kv_cache=0.9, running=3), 1: ReplicaLoad(kv_cache=0.9, running=3)},
                                 2, Memory(), 4, R.SCALED_UP),
    "ttft p90 over target": (TTFT, {0: ReplicaLoad(running=1, ttft_buckets=BUCKETS)}, 2, Memory(), 5, R.SCALED_UP),
    "no request started in the period, streams running: kept": (TTFT, {0: ReplicaLoad(running=4)}, 2,
                                                                Memory(below_since=ago(900)), 2, R.WITHIN_TARGET),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decide(case):
    spec, loads, replicas, memory, desired, reason = CASES[case]
    v = decide(loads, replicas, spec, memory, NOW, GRACE)
    if reason is None:          # held: the replica's streams first
        assert (v.desired, v.reason) == (replicas, R.DRAINING), v
        return
    assert (v.desired, v.reason) == (desired, reason), v


def test_the_delay_counts_from_when_the_load_first_fell_and_a_rise_resets_it():
    first = decide(IDLE, 3, QUEUE, Memory(), NOW, GRACE)
    assert first.reason == R.DELAYED and first.memory.below_since == NOW
    later = decide(IDLE, 3, QUEUE, first.memory, NOW + timedelta(seconds=30), GRACE)
    assert later.memory.below_since == NOW and later.desired == 3
    busy = decide(q(4, 4, 4), 3, QUEUE, later.memory, NOW + timedelta(seconds=40), GRACE)
    assert busy.memory.below_since is None and busy.reason == R.WITHIN_TARGET
    again = decide(IDLE, 3, QUEUE, busy.memory, NOW + timedelta(seconds=61), GRACE)
    assert again.reason == R.DELAYED, "the delay starts over after the load rose"


def test_a_scale_is_remembered_and_said_in_one_line():
    v = decide(q(12), 1, QUEUE, Memory(), NOW, GRACE)
    assert v.scales and v.memory.last_scale == NOW
    status = v.status(QUEUE.value)
    assert status["desiredReplicas"] == 3 and status["reason"] == "ScaledUp" and status["observedValue"] == 12
    assert status["lastScaleTime"] == "2026-01-01T12:00:00.000Z"
    assert Memory.from_status(status).last_scale == NOW
    assert Memory.from_status({"lastScaleTime": "yesterday", "belowSince": 7}) == Memory()
    text = message(v, 1, QUEUE)
    assert text == "replicas 1 -> 3: queueDepthPerReplica 12 per replica, target 4 (1-4 replicas)"


def test_requests_held_at_the_front_door_wake_a_model_at_zero():
    v = decide({}, 0, ZERO, Memory(), NOW, GRACE, held=3)
    assert (v.desired, v.reason) == (1, R.SCALED_UP)
    assert message(v, 0, ZERO, held=3) == "replicas 0 -> 1: 3 requests held at the router (0-4 replicas)"


def test_quantile_is_prometheus_histogram_quantile():
    assert quantile(BUCKETS) == pytest.approx(1 + 1.5 * 70 / 80)
    assert quantile(((1.0, 0.0), (float("inf"), 0.0))) is None
    assert quantile(((1.0, 1.0), (float("inf"), 10.0))) == 1.0      # in +Inf: the highest finite bound
