"""report: the ShardedModel's status, its phase-change Event and its metrics, from one pass's
decision. `build_status` is pure; `record_metrics` sets the Prometheus series.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from shardwise.crds.models import GroupPhase, PlanSummary
from shardwise.operator.decide import elastic
from shardwise.operator.controller import metrics
from shardwise.operator.decide import recovery
from shardwise.operator.render import renderer
from shardwise.operator.decide import status as status_mod
from shardwise.operator.decide.decisions import Decision, Event, planned
from shardwise.operator.decide.state import ModelState

WARNING_PHASES = (status_mod.FAILED, status_mod.DEGRADED, status_mod.RECOVERING)


def build_status(state: ModelState, decision: Decision, job: Mapping[str, Any], now: datetime) -> dict:
    """The whole status after this pass. `job`: status.training/lastCheckpoint of a training job as
    its pods report them ({} when none answered)."""
    if state.model is None:
        return _invalid_spec_status(state, now)
    stamp = recovery.iso(now)
    plan = decision.plan if decision.plan is not None and decision.plan.placements else None
    # the replicas it runs with: a training job may run fewer than asked (elastic), and is whole then
    desired, workload = (decision.size if decision.size is not None else state.desired), state.workload
    live = [decision.groups[r] for r in sorted(decision.groups) if r < desired]
    phase = status_mod.model_phase(live, desired, decision.invalid)
    message = status_mod.phase_message(live, desired, decision.invalid, job=workload.gang)
    phase, override = workload.model_phase(phase, decision.finished, desired)
    message = override or message
    if elastic.shrunk_reason(plan) and not decision.finished:
        message += f"; {elastic.shrunk_reason(plan)}"
    done = job.get("training") or state.status.get("training")
    if workload.gang and done and done.get("steps"):
        message += f"; step {done.get('step', 0)} of {done['steps']}"
    out = {
        "phase": phase, "message": message,
        "conditions": _conditions(state, decision, live, phase, message, stamp),
        "observedGeneration": state.generation,
        "restarts": workload.restarts(decision.groups.values()),
        "tensor": plan.tensor if plan else None, "pipeline": plan.pipeline if plan else None,
        "replicas": len(planned(plan)),
        "readyReplicas": sum(g.phase in (GroupPhase.READY, GroupPhase.OUTDATED) for g in live),
        "readyShards": ready_shards(state, decision),
        "selector": f"{renderer.LABEL_MODEL}={state.name},{renderer.LABEL_STAGE}=0",
        "endpoint": renderer.endpoint(state.model)
        if plan and workload.serves else None,
        "plan": PlanSummary.from_plan(plan).to_api() if plan else None,
        "groups": [decision.groups[r].to_api() for r in sorted(decision.groups)],
        "modelFacts": decision.facts.to_api() if decision.facts else None,
        **job,
    }
    return out


def ready_shards(state: ModelState, decision: Decision) -> int:
    """Stage pods Ready, across the desired replicas' current attempts."""
    if decision.plan is None:
        return 0
    count = 0
    for r in range(state.desired):
        g = decision.groups.get(r)
        attempt = str(g.attempt if g else 0)
        count += sum(recovery.pod_ready(p) for p in state.pods.get(r, [])
                     if p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == attempt)
    return count


def _conditions(state: ModelState, decision: Decision, live: list, phase: str, message: str,
                stamp: str) -> list[dict]:
    conditions = list(state.status.get("conditions") or [])
    plan, invalid = decision.plan, decision.invalid
    pending = [g for g in live if g.phase == GroupPhase.PENDING]
    planned_ok = plan is not None and not invalid and not pending
    reason = "InvalidSpec" if invalid else ("Planned" if planned_ok else "NoFeasiblePlan")
    why = invalid or next((g.last_failure for g in pending if g.last_failure), None) or (
        f"TP={plan.tensor} PP={plan.pipeline} cost={plan.cost}" if plan else "not planned")
    conditions = status_mod.set_condition(conditions, "Planned", planned_ok, reason, why, stamp)
    conditions = status_mod.set_condition(conditions, "Ready", phase in (status_mod.READY, status_mod.RUNNING),
                                          phase, message, stamp)
    unscheduled = _unscheduled(state, decision)
    conditions = status_mod.set_condition(
        conditions, "PodsScheduled", not unscheduled, "Unschedulable" if unscheduled else "Scheduled",
        "; ".join(unscheduled) or "every pod of the plan is placed or on its way", stamp)
    recovering = [g for g in live if g.phase == GroupPhase.RECOVERING]
    conditions = status_mod.set_condition(
        conditions, "Recovering", bool(recovering), "GroupFailed" if recovering else "Healthy",
        "; ".join(f"replica {g.replica}: {g.last_failure}" for g in recovering) or "no group is recovering", stamp)
    return _shrunk_condition(conditions, state, plan, stamp)


def _shrunk_condition(conditions: list[dict], state: ModelState, plan: Any, stamp: str) -> list[dict]:
    """Shrunk: True while the plan in effect runs fewer replicas than asked (elastic training, or a
    served model with recovery.allowShrink), with the planner's reason."""
    why = elastic.shrunk_reason(plan if plan is not None and plan.placements else None)
    if not why and status_mod.condition(conditions, "Shrunk") is None:
        return conditions       # never shrunk: no condition to keep up to date
    return status_mod.set_condition(conditions, "Shrunk", bool(why), "ShortOfCapacity" if why else "FullSize",
                                    why or f"running all {state.desired} replicas asked", stamp)


def _unscheduled(state: ModelState, decision: Decision) -> list[str]:
    """Gang scheduling: a group is only as scheduled as its least lucky pod; say why, in the
    scheduler's words, while we wait (after the grace period the group is re-planned)."""
    out = []
    for r in range(state.desired):
        g = decision.groups.get(r)
        attempt = str(g.attempt if g else 0)
        for p in state.pods.get(r, []):
            why = recovery.unschedulable_message(p)
            if why and p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == attempt:
                out.append(f"pod {p['metadata']['name']}: {why}")
    return out


def _invalid_spec_status(state: ModelState, now: datetime) -> dict:
    stamp = recovery.iso(now)
    reason = "InvalidSpec"
    conditions = status_mod.set_condition(state.status.get("conditions"), "Planned", False, reason,
                                          state.invalid, stamp)
    conditions = status_mod.set_condition(conditions, "Ready", False, status_mod.FAILED, state.invalid, stamp)
    return {"phase": status_mod.FAILED, "message": state.invalid, "conditions": conditions,
            "observedGeneration": state.generation}


def phase_event(state: ModelState, new: Mapping[str, Any]) -> Event | None:
    """An Event when the model's phase changes (a spec that does not parse says so once)."""
    if new["phase"] == state.status.get("phase"):
        return None
    if state.model is None:
        return Event("Warning", "InvalidSpec", new["message"])
    return Event("Warning" if new["phase"] in WARNING_PHASES else "Normal", new["phase"], new["message"])


def changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(old.get(k) != v for k, v in new.items())


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


def _training_metrics(state: ModelState, decision: Decision, new: Mapping[str, Any], now: datetime) -> None:
    """Replicas running vs asked; the age of the newest checkpoint of each tier (the work a failure
    would lose now, were the job to resume from it)."""
    ns, name = state.namespace, state.name
    metrics.REPLICAS_ASKED.labels(ns, name).set(state.desired)
    metrics.REPLICAS_RUNNING.labels(ns, name).set(len(planned(decision.plan)) if new.get("phase") == "Running" else 0)
    for tier, key in (("shared", "lastCheckpoint"), ("local", "lastLocalCheckpoint")):
        when = recovery.parse_iso((new.get(key) or state.status.get(key) or {}).get("time"))
        if when is not None:
            metrics.CHECKPOINT_AGE.labels(ns, name, tier).set(max(0.0, (now - when).total_seconds()))
