"""report: the Prometheus series one pass sets (recoveries, plan time, shards and replicas ready,
training progress, checkpoint ages). The status itself is built by decide/status.py (pure); the
reconciler patches it and posts its Events.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from shardwise.crds.models import ModelPhase
from shardwise.operator.controller import metrics
from shardwise.operator.decide import recovery
from shardwise.operator.decide.actions import Decision
from shardwise.operator.planning.groups import planned
from shardwise.operator.decide.state import ModelState


def record_metrics(state: ModelState, decision: Decision, new: Mapping[str, Any], now: datetime | None = None) -> None:
    ns, name = state.namespace, state.name
    for seconds in decision.recovered:
        metrics.RECOVERY_SECONDS.labels(ns, name).observe(seconds)
    for cause in decision.recoveries:
        metrics.RECOVERIES.labels(ns, name, cause).inc()
    if decision.plan_seconds is not None:
        metrics.PLAN_SECONDS.observe(decision.plan_seconds)
    if decision.plan is not None and state.model is not None:
        metrics.SHARDS_DESIRED.labels(ns, name).set(state.desired * decision.plan.pipeline)
        metrics.PLAN_COST.labels(ns, name).set(decision.plan.cost)
    metrics.SHARDS_READY.labels(ns, name).set(new.get("readyShards", 0))
    metrics.REPLICAS_READY.labels(ns, name).set(new.get("readyReplicas", 0))
    if new.get("training"):
        metrics.TRAINING_STEP.labels(ns, name).set(new["training"]["step"])
    last = recovery.parse_iso((new.get("lastCheckpoint") or {}).get("time"))
    if last is not None:
        metrics.CHECKPOINT_STEP.labels(ns, name).set(new["lastCheckpoint"]["step"])
        metrics.CHECKPOINT_TIME.labels(ns, name).set(last.timestamp())
    if state.model is not None and state.workload.gang:
        _training_metrics(state, decision, new, now or recovery.now_utc())
    if state.model is not None and state.spec.model.remote_scheme():
        downloads = new.get("download") or []
        metrics.DOWNLOAD_RATE.labels(ns, name).set(sum(d["rate"] for d in downloads))
        metrics.DOWNLOAD_FETCHED.labels(ns, name).set(sum(d["bytesFetched"] for d in downloads))
        metrics.DOWNLOAD_TOTAL.labels(ns, name).set(sum(d["bytesTotal"] for d in downloads))


def _training_metrics(state: ModelState, decision: Decision, new: Mapping[str, Any], now: datetime) -> None:
    """Replicas running vs asked; the age of the newest checkpoint of each tier (the work a failure
    would lose now, were the job to resume from it)."""
    ns, name = state.namespace, state.name
    metrics.REPLICAS_ASKED.labels(ns, name).set(state.desired)
    metrics.REPLICAS_RUNNING.labels(ns, name).set(len(planned(decision.plan)) if new.get("phase") == ModelPhase.RUNNING else 0)
    for tier, key in (("shared", "lastCheckpoint"), ("local", "lastLocalCheckpoint")):
        when = recovery.parse_iso((new.get(key) or state.status.get(key) or {}).get("time"))
        if when is not None:
            metrics.CHECKPOINT_AGE.labels(ns, name, tier).set(max(0.0, (now - when).total_seconds()))
