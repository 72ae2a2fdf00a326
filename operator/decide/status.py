"""The ShardedModel's status after one pass, from its groups and the pass's decision (pure, no I/O):
`build_status` (the whole status), the phase and its message, the conditions, the phase-change Event.
The reconciler patches what this builds; controller/report.py sets the metrics.

Phase of the whole model (crds ModelPhase), from its replica groups:
  Pending     no group has capacity (or nothing planned yet)
  Starting    groups created, not all Ready yet, nothing failed
  Ready       every desired replica Ready
  Running     training: every replica of the job has all its ranks up (workloads.py)
  Recovering  a group lost a pod/node and is being recreated (other replicas keep serving)
  Degraded    some replicas serve, others cannot (no capacity or restart budget spent)
  Failed      nothing can serve: the spec cannot be planned, or every group spent its restarts
  Succeeded   training finished on every replica

Conditions (type: status, reason): Planned, Ready, PodsScheduled, Recovering, Shrunk; each with a
one-line message (conditions.py keeps their lastTransitionTime as Kubernetes conventions want).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping

from shardwise.crds import names
from shardwise.crds.models import GroupPhase, ModelPhase, PlanSummary, ReplicaGroupStatus
from shardwise.crds.status import group_records, shortened
from shardwise.operator.decide import elastic, prepull, recovery
from shardwise.operator.decide.conditions import condition, set_condition
from shardwise.operator.decide.actions import Decision, Event
from shardwise.operator.planning.groups import planned
from shardwise.operator.decide.state import ModelState
from shardwise.operator.render import renderer

# Phases that post their change as a Warning Event.
WARNING_PHASES = (ModelPhase.FAILED, ModelPhase.DEGRADED, ModelPhase.RECOVERING)
# A message names at most this many replicas or pods, each in at most ITEM_MAX_CHARS, and counts
# the rest: with thousands of replicas failing at once it stays a line, and under the API's 32 KiB
# bound on a condition's message (a longer one fails the whole status write).
MAX_LISTED = 8
ITEM_MAX_CHARS = 200


def listed(items: Iterable[str]) -> str:
    """`items` joined with "; ", the first MAX_LISTED of them, then how many more there are."""
    items = list(items)
    shown = "; ".join(shortened(item, ITEM_MAX_CHARS) for item in items[:MAX_LISTED])
    return shown + (f"; and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def model_phase(groups: Iterable[ReplicaGroupStatus], desired: int, invalid: str = "") -> ModelPhase:
    """`invalid`: why the spec cannot run at all (not a capacity problem) - terminal until it changes."""
    if invalid:
        return ModelPhase.FAILED
    # An Outdated group still serves (on the old layout) until its replacement is Ready.
    phases = [GroupPhase.READY if g.phase == GroupPhase.OUTDATED else g.phase
              for g in groups if g.replica < desired]
    phases += [GroupPhase.PENDING] * (desired - len(phases))
    if desired == 0:
        return ModelPhase.READY
    if all(p == GroupPhase.SUCCEEDED for p in phases):
        return ModelPhase.SUCCEEDED
    ready = phases.count(GroupPhase.READY)
    if ready == desired:
        return ModelPhase.READY
    if GroupPhase.RECOVERING in phases:
        return ModelPhase.RECOVERING
    stuck = sum(p in (GroupPhase.FAILED, GroupPhase.PENDING) for p in phases)
    if ready and stuck:
        return ModelPhase.DEGRADED
    if stuck == desired:
        return ModelPhase.FAILED if all(p == GroupPhase.FAILED for p in phases) else ModelPhase.PENDING
    return ModelPhase.STARTING


def phase_message(groups: list[ReplicaGroupStatus], desired: int, invalid: str = "", job: bool = False) -> str:
    """`job`: the groups are one training job's replicas, which share their failure: told once."""
    ready = sum(g.phase == GroupPhase.READY for g in groups if g.replica < desired)
    base = f"{ready}/{desired} replicas ready"
    failures = list(dict.fromkeys(
        f"{'training job' if job else 'replica ' + str(g.replica)}: {g.last_failure}" for g in groups
        if g.phase in (GroupPhase.RECOVERING, GroupPhase.FAILED, GroupPhase.PENDING) and g.last_failure))
    if invalid:
        failures.insert(0, invalid)
    return base + ("; " + listed(failures) if failures else "")


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
    phase = model_phase(live, desired, decision.invalid)
    message = phase_message(live, desired, decision.invalid, job=workload.gang)
    phase, override = workload.model_phase(phase, decision.finished, desired)
    message = override or message
    surge = sum(g.phase == GroupPhase.READY for r, g in decision.groups.items() if r >= desired)
    if surge and workload.serves:
        message += f"; {surge} surge replica(s) of a roll serving"
    if elastic.shrunk_reason(plan) and not decision.finished:
        message += f"; {elastic.shrunk_reason(plan)}"
    done = job.get("training") or state.status.get("training")
    if workload.gang and done and done.get("steps"):
        message += f"; step {done.get('step', 0)} of {done['steps']}"
    out = {
        "phase": phase.value, "message": message,
        "conditions": _conditions(state, decision, live, phase, message, stamp),
        "observedGeneration": state.generation,
        "restarts": workload.restarts(decision.groups.values()),
        "tensor": plan.tensor if plan else None, "pipeline": plan.pipeline if plan else None,
        "replicas": len({r for r in planned(plan) if r < desired}),
        # a roll's surge replicas (decide/rollout.py) serve in place of the desired ones being replaced
        "readyReplicas": min(desired, sum(g.phase in (GroupPhase.READY, GroupPhase.OUTDATED)
                                          for g in decision.groups.values())),
        "readyShards": ready_shards(state, decision),
        "selector": f"{names.LABEL_MODEL}={state.name},{names.LABEL_STAGE}=0",
        "endpoint": renderer.endpoint(state.model)
        if plan and workload.serves else None,
        "plan": PlanSummary.from_plan(plan).to_api() if plan else None,
        "groups": group_records(decision.groups.values()),
        "modelFacts": decision.facts.to_api() if decision.facts else None,
        "nodeCache": decision.node_cache.to_api() if decision.node_cache else None,
        **job,
    }
    prepull.report(out, decision.prepull_note, stamp)
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
                     if p["metadata"]["labels"].get(names.LABEL_ATTEMPT) == attempt)
    return count


def _conditions(state: ModelState, decision: Decision, live: list, phase: ModelPhase, message: str,
                stamp: str) -> list[dict]:
    conditions = list(state.status.get("conditions") or [])
    plan, invalid = decision.plan, decision.invalid
    pending = [g for g in live if g.phase == GroupPhase.PENDING]
    planned_ok = plan is not None and not invalid and not pending
    reason = "InvalidSpec" if invalid else ("Planned" if planned_ok else "NoFeasiblePlan")
    why = invalid or next((g.last_failure for g in pending if g.last_failure), None) or (
        f"TP={plan.tensor} PP={plan.pipeline} cost={plan.cost}" if plan else "not planned")
    conditions = set_condition(conditions, "Planned", planned_ok, reason, why, stamp)
    conditions = set_condition(conditions, "Ready", phase in (ModelPhase.READY, ModelPhase.RUNNING),
                               phase.value, message, stamp)
    unscheduled = _unscheduled(state, decision)
    conditions = set_condition(
        conditions, "PodsScheduled", not unscheduled, "Unschedulable" if unscheduled else "Scheduled",
        listed(unscheduled) or "every pod of the plan is placed or on its way", stamp)
    recovering = [g for g in live if g.phase == GroupPhase.RECOVERING]
    conditions = set_condition(
        conditions, "Recovering", bool(recovering), "GroupFailed" if recovering else "Healthy",
        listed(f"replica {g.replica}: {g.last_failure}" for g in recovering) or "no group is recovering", stamp)
    if condition(conditions, "Applied") is not None:   # an ObjectConflict of an earlier pass is over
        conditions = set_condition(conditions, "Applied", True, "Applied",
                                   "every object the model makes is its own", stamp)
    return _shrunk_condition(conditions, state, plan, stamp)


def _shrunk_condition(conditions: list[dict], state: ModelState, plan: Any, stamp: str) -> list[dict]:
    """Shrunk: True while the plan in effect runs fewer replicas than asked (elastic training, or a
    served model with recovery.allowShrink), with the planner's reason."""
    why = elastic.shrunk_reason(plan if plan is not None and plan.placements else None)
    if not why and condition(conditions, "Shrunk") is None:
        return conditions       # never shrunk: no condition to keep up to date
    return set_condition(conditions, "Shrunk", bool(why), "ShortOfCapacity" if why else "FullSize",
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
            if why and p["metadata"]["labels"].get(names.LABEL_ATTEMPT) == attempt:
                out.append(f"pod {p['metadata']['name']}: {why}")
    return out


def _invalid_spec_status(state: ModelState, now: datetime) -> dict:
    stamp = recovery.iso(now)
    reason = "InvalidSpec"
    conditions = set_condition(state.status.get("conditions"), "Planned", False, reason,
                                          state.invalid, stamp)
    conditions = set_condition(conditions, "Ready", False, ModelPhase.FAILED, state.invalid, stamp)
    return {"phase": ModelPhase.FAILED.value, "message": state.invalid, "conditions": conditions,
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
