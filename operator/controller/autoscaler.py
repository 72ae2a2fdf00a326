"""Autoscaling, observe and act: every spec.autoscaling.periodSeconds, read the /metrics of each
Ready stage-0 pod of a serving model (the model-server protocol's queue, running requests and
KV-cache use, and shardwise's time-to-first-token histogram), let decide/autoscaling.py choose the
replicas, and when they change, set them through the scale subresource, the same door `kubectl
scale` and an HPA use; the reconciler then adds or drains replicas as for any change of
spec.parallelism.replicas. The decision and its times go to status.autoscaling; a change is an Event.

A pod's numbers are the tenant's: each read is bounded in bytes and time, parsed by
prometheus_client's text parser, and every value clamped to what the worker could report; a pod
that does not answer is a replica that did not report (decide/ treats it as such).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from datetime import datetime
from typing import Any, Callable, Iterable, Mapping, Optional

from shardwise.crds import names
from shardwise.crds.capacity import MAX_SEQUENCES, MAX_WAITING
from shardwise.crds.contract import SERVING_GRACE_SECONDS
from shardwise.crds.models import ShardedModelSpec, Workload
from shardwise.operator.controller import podhttp
from shardwise.operator.controller.apply import Applier
from shardwise.operator.decide import autoscaling, recovery
from shardwise.operator.decide.autoscaling import ReplicaLoad
from shardwise.operator.decide.decisions import Event
from shardwise.operator.render.renderer import router_enabled

log = logging.getLogger("shardwise.operator")
METRICS_TIMEOUT = 2.0          # seconds for one pod's whole /metrics read
METRICS_MAX_BYTES = 1 << 20    # a worker's /metrics is a few tens of KiB (more with many MoE experts)
MAX_BUCKETS = 64               # histogram buckets kept of one pod (the worker has 14)
MAX_COUNT = 1e15               # a counter no pod reaches
READERS = 16                   # pods read at once
MAX_HELD = 1 << 20             # requests one router pod is believed to hold at most

Buckets = tuple[tuple[float, float], ...]
Reader = Callable[[Mapping[str, Any]], Optional[str]]


def _clamp(value: float, high: float) -> float:
    return min(high, max(0.0, value)) if math.isfinite(value) else 0.0


def parse(text: str) -> tuple[ReplicaLoad, Buckets]:
    """One pod's load (its TTFT histogram cumulative since the pod started) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    gauges: dict[str, float] = {}
    buckets: dict[float, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in (names.METRIC_QUEUED, names.METRIC_RUNNING, names.METRIC_KV_CACHE[0]):
                    gauges[s.name] = float(s.value)
                elif s.name == names.METRIC_TTFT + "_bucket" and len(buckets) < MAX_BUCKETS:
                    bound = float(s.labels.get("le", "nan"))
                    if not math.isnan(bound):       # summed over endpoints
                        buckets[bound] = buckets.get(bound, 0.0) + _clamp(float(s.value), MAX_COUNT)
    except Exception as e:  # noqa: BLE001 - the text is a pod's: whatever it holds, it is not a load
        raise ValueError(f"unreadable metrics ({type(e).__name__})") from None
    load = ReplicaLoad(waiting=_clamp(gauges.get(names.METRIC_QUEUED, 0.0), MAX_WAITING),
                       running=_clamp(gauges.get(names.METRIC_RUNNING, 0.0), MAX_SEQUENCES),
                       kv_cache=_clamp(gauges.get(names.METRIC_KV_CACHE[0], 0.0), 1.0))
    return load, tuple(sorted(buckets.items()))


def parse_held(text: str) -> int:
    """The requests a router pod holds now, waiting for a Ready replica, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == names.METRIC_ROUTER_HELD:
                    return int(_clamp(float(s.value), MAX_HELD))
    except Exception as e:  # noqa: BLE001 - a pod's text: whatever it holds, it is no count
        raise ValueError(f"unreadable metrics ({type(e).__name__})") from None
    return 0


def read_metrics(pod: Mapping[str, Any]) -> Optional[str]:
    """GET /metrics of a pod, None when it does not answer within the bounds."""
    address = podhttp.http_address(pod)
    if address is None:
        return None
    try:
        body = podhttp.get(*address, "/metrics", time.monotonic() + METRICS_TIMEOUT, METRICS_MAX_BYTES,
                           accept="text/plain")
        return body.decode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - refused, reset, timed out, too large, bad HTTP: no answer
        log.debug(f"no metrics from pod {pod['metadata'].get('name')}: {type(e).__name__}")
        return None


def stage0_pods(pods: Iterable[Mapping[str, Any]], replicas: int) -> dict[int, Mapping[str, Any]]:
    """The Ready stage-0 pod of each replica below `replicas` (its newest attempt, not terminating)."""
    out: dict[int, Mapping[str, Any]] = {}
    for pod in pods:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        try:
            replica, stage = int(labels[names.LABEL_REPLICA]), int(labels[names.LABEL_STAGE])
            attempt = int(labels.get(names.LABEL_ATTEMPT, 0))
        except (KeyError, ValueError):
            continue
        if stage != 0 or replica >= replicas or meta.get("deletionTimestamp") or not recovery.pod_ready(pod):
            continue
        held = out.get(replica)
        if held is None or attempt > int((held["metadata"].get("labels") or {}).get(names.LABEL_ATTEMPT, 0)):
            out[replica] = pod
    return out


class Autoscaler:
    """The autoscaling pass of every model, and what it keeps between passes: each pod's last TTFT
    histogram (by pod uid), so a pass sees the requests of its period only."""

    def __init__(self, read: Reader = read_metrics):
        self.read = read
        self.histograms: dict[str, Buckets] = {}
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="metrics")

    def loads(self, pods: Mapping[int, Mapping[str, Any]]) -> dict[int, ReplicaLoad]:
        """What each pod reports; a pod that does not answer (or answers nonsense) is left out."""
        texts = dict(zip(pods, self.pool.map(self.read, pods.values())))
        out: dict[int, ReplicaLoad] = {}
        for replica, text in texts.items():
            if text is None:
                continue
            try:
                load, cumulative = parse(text)
            except ValueError as e:
                log.warning(f"ignoring pod {pods[replica]['metadata'].get('name')}'s metrics: {e}")
                continue
            out[replica] = self._period(pods[replica], load, cumulative)
        return out

    def _period(self, pod: Mapping[str, Any], load: ReplicaLoad, cumulative: Buckets) -> ReplicaLoad:
        """The load with its TTFT histogram since the last read of this pod (none at the first read)."""
        uid = pod["metadata"].get("uid") or pod["metadata"].get("name", "")
        with self.lock:
            before = dict(self.histograms.get(uid, ()))
            self.histograms[uid] = cumulative
        if not before:
            return load
        delta = tuple((b, max(0.0, c - before.get(b, 0.0))) for b, c in cumulative)
        return ReplicaLoad(load.waiting, load.running, load.kv_cache, delta)

    def held(self, pods: Iterable[Mapping[str, Any]]) -> int:
        """Requests the model's Ready router pods hold now for want of a Ready replica; a pod that
        does not answer (or answers nonsense) holds none."""
        ready = [p for p in pods if recovery.pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
        total = 0
        for pod, text in zip(ready, self.pool.map(self.read, ready)):
            try:
                total += parse_held(text) if text is not None else 0
            except ValueError as e:
                log.warning(f"ignoring router pod {pod['metadata'].get('name')}'s metrics: {e}")
        return total

    def forget(self, live: Iterable[Mapping[str, Any]]) -> None:
        """Drop the histograms of pods gone (bounded by the pods that exist)."""
        uids = {p["metadata"].get("uid") or p["metadata"].get("name", "") for p in live}
        with self.lock:
            for uid in [u for u in self.histograms if u not in uids]:
                self.histograms.pop(uid, None)

    def run(self, applier: Applier, namespace: str, name: str,
            now: Callable[[], datetime] = recovery.now_utc) -> tuple[list[Event], Optional[float]]:
        """One pass over one model: the Events it made and the seconds to the next (None: the model
        is gone or has no spec.autoscaling, nothing to do)."""
        body = applier.get_model(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return [], None
        try:
            model = ShardedModelSpec.model_validate(body.get("spec") or {})
        except ValueError:
            return [], None    # the reconciler says why in status
        spec = model.autoscaling
        if spec is None or model.workload == Workload.TRAINING:
            return [], None
        replicas = model.parallelism.replicas
        pods = applier.list_model_pods(namespace, name)
        loads = self.loads(stage0_pods(pods, replicas))
        self.forget(pods)
        # at zero nothing runs to report load: requests held at the router wake the model
        held = self.held(applier.list_router_pods(namespace, name)) if replicas == 0 and router_enabled(model) else 0
        stored = (body.get("status") or {}).get("autoscaling") or {}
        verdict = autoscaling.decide(loads, replicas, spec, autoscaling.Memory.from_status(stored), now(),
                                     SERVING_GRACE_SECONDS, held=held)
        events = []
        if verdict.scales and verdict.desired != replicas:
            applier.scale(namespace, name, verdict.desired)
            text = autoscaling.message(verdict, replicas, spec, held)
            log.info(f"{namespace}/{name}: {text}")
            events.append(Event("Normal", verdict.reason.value, text))
        new = verdict.status(spec.value)
        if any(stored.get(k) != v for k, v in new.items()):
            applier.patch_autoscaling_status(namespace, name, new)
        return events, float(spec.period_seconds)
