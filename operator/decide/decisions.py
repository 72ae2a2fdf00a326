"""decide(): what one reconcile pass does for one ShardedModel. Pure: no API calls, no clock (`now` is
given), no metrics; it returns the actions in the order they must run, the group records and plan to
store, and the Events to post. `reconciler.py` observes, calls this, then acts and reports.

One pass, in order:
  1. a changed spec reopens the groups that gave up (and a finished job asked for more steps);
  2. the workload's reshaping rule: a training job restarts whole when its layout, replica count or
     spec changed, or when it runs short (elastic) and a wider plan fits now; a served model marks
     the groups of an old layout Outdated (replaced as spec.rollout says: decide/rollout.py);
  3. replicas beyond spec.parallelism.replicas, and beyond a roll's surge replicas, are torn down (a
     paused training job keeps its records);
  4. each desired replica and surge replica: rolled (Outdated, or its pods of an old spec), judged from its pods
     (recovery.assess -> recovery.decide; one verdict for a gang), then created, torn down or left;
  5. every group that needs a plan is planned in one planner call, with the model's shape (read by a
     probe pod for a pvc:// model); the new plan is stored in the plan ConfigMap, then the group
     records, then the pods are created: a pass interrupted anywhere leaves state a later pass
     recognises (pods are named by replica, stage and attempt, and created with create-or-get).
     A training job is planned whole at the largest size that fits (elastic.py), once every pod of
     its previous run is gone (they may be saving a checkpoint);
  6. pods of an older attempt of a live group (an interrupted teardown) are deleted;
  7. with spec.model.prePull, the creation of a group waits for its nodes' pre-pull (prepull.py).
"""
from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

from shardwise.crds import names
from shardwise.crds.models import GroupPhase, ModelFactsStatus, ReplicaGroupStatus
from shardwise.crds.modelshape import ModelFacts, ModelFactsError
from shardwise.crds.plan import ShardPlan
from shardwise.operator.decide import elastic, nodecache, prepull, probe, recovery, rollout
from shardwise.operator.decide.actions import (NOT_READY_REQUEUE, STEADY_REQUEUE, Action, ApplyShared, CreatePods,
                                               CreatePrePull, CreateProbe, Decision, DeleteGroup, DeletePods, Event,
                                               SaveGroups, World)
from shardwise.operator.decide.conditions import condition
from shardwise.operator.decide.recovery import StepAction
from shardwise.operator.decide.rollout import outdated_pods as _outdated_pods
from shardwise.operator.decide.state import ModelState
from shardwise.operator.decide.workloads import finished
from shardwise.operator.planning import groups as planning
from shardwise.operator.planning.groups import drop_replicas, merge_plan, planned
from shardwise.operator.render import renderer

__all__ = ["NOT_READY_REQUEUE", "STEADY_REQUEUE", "Action", "ApplyShared", "CreatePods", "CreatePrePull", "CreateProbe",
           "Decision", "DeleteGroup", "DeletePods", "Event", "SaveGroups", "World", "decide"]

# Group phases in which a pass has nothing on its way for the group (no quick requeue).
SETTLED = (GroupPhase.READY, GroupPhase.FAILED, GroupPhase.SUCCEEDED, GroupPhase.PENDING, GroupPhase.RECOVERING)


# --- the pass ------------------------------------------------------------------------------------

def decide(state: ModelState, world: World, now: datetime) -> Decision:
    if state.model is None:
        return Decision([], dict(state.groups), None, [], STEADY_REQUEUE, invalid=state.invalid)
    d = _Draft(state, world, now)
    _reopen_after_spec_change(d)
    if d.workload.gang:
        _restart_job_if_reshaped(d)
        _grow_when_capacity_returns(d)
    else:
        _mark_old_layout_outdated(d)
    _scale_down(d)
    _judge_groups(d)
    if d.replan:
        _plan(d)
        rollout.after_plan(d)
    if d.extent > d.desired:
        _scale_down(d)      # a roll that ended in this pass removes its surge replicas in it
    _remove_leftovers(d)
    _gate_on_prepull(d)
    return d.decision()


class _Draft:
    """The working copy one pass edits: group records, the plan, the pods left, what to do."""

    def __init__(self, state: ModelState, world: World, now: datetime):
        self.state, self.world, self.now = state, world, now
        self.spec, self.workload, self.policy = state.spec, state.workload, state.policy
        # A training job runs at its stored plan's size, which may be short of the replicas asked.
        self.desired = elastic.running_size(state.spec, state.plan) if self.workload.gang else state.desired
        self.groups = {r: g.model_copy() for r, g in state.groups.items()}
        self.pods = {r: list(p) for r, p in state.pods.items()}
        self.stored = state.plan
        # The plan in effect: the stored one unless the spec asks for another layout.
        matches = state.plan is not None and planning.layout_matches(state.plan, state.spec)
        self.plan = state.plan if matches else None
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.requeue = STEADY_REQUEUE
        self.replan: list[int] = []
        self.taken = 0               # old replicas taken down for their successors this pass
        self.extent = self.desired   # desired replicas, and a serving roll's surge replicas after them
        self.unplaced: list[int] = []   # replicas the planner found no room for this pass
        self.shared = False          # shared objects applied this pass
        self.invalid = ""
        self.facts = state.facts
        self.recovered: list[float] = []
        self.recoveries: list[str] = []
        self.plan_seconds: float | None = None
        # the planner prefers these nodes among equals
        self.node_cache = nodecache.update(state, prepull.succeeded_nodes(state))
        self.prepulling: tuple[CreatePods, ...] = ()
        self.prepull_note = ""

    @property
    def warm(self) -> list[str]:
        return self.node_cache.nodes if self.node_cache is not None else []

    def act(self, action: Action) -> None:
        self.actions.append(action)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def requeue_in(self, seconds: float) -> None:
        self.requeue = min(self.requeue, max(0.2, seconds))

    def save(self) -> None:
        self.act(SaveGroups(self.plan, tuple(self.groups[r] for r in sorted(self.groups))))

    def apply_shared(self, again: bool = False) -> None:
        if self.plan is not None and (again or not self.shared):
            self.act(ApplyShared(self.plan))
            self.shared = True

    def group(self, r: int) -> ReplicaGroupStatus:
        return self.groups.setdefault(r, ReplicaGroupStatus(replica=r))

    def decision(self) -> Decision:
        return Decision(self.actions, self.groups, self.plan, self.events, self.requeue, self.invalid,
                        self.workload.gang and finished(self.groups.values()), self.facts,
                        self.recovered, self.recoveries, self.plan_seconds, self.desired, self.node_cache,
                        self.prepulling, self.prepull_note)


# --- 1-3: spec changes, reshaping, scaling down ---------------------------------------------------

def _reopen_after_spec_change(d: _Draft) -> None:
    """A changed spec is a fresh start for groups that gave up (restart budget spent), and for a
    finished training job asked for more steps than it did."""
    if not d.state.spec_changed:
        return
    done = int((d.state.status.get("training") or {}).get("steps") or 0)
    more_steps = d.workload.gang and d.spec.training is not None and d.spec.training.steps > done
    for g in d.groups.values():
        if g.phase == GroupPhase.FAILED or (more_steps and g.phase == GroupPhase.SUCCEEDED):
            g.phase, g.restarts, g.last_failure, g.retry_at = GroupPhase.PENDING, 0, None, None


def _restart_job_if_reshaped(d: _Draft) -> None:
    """A training job whose world changes shape stops whole and is planned again; it resumes from
    its last complete checkpoint. No restart is counted: nothing failed."""
    why = _job_restart_reason(d)
    if not why:
        return
    _stop_job(d)
    if d.desired == 0:
        d.event("Normal", "Paused", f"{why}: the training job is stopped; scaled up again, it resumes from "
                                    f"the last complete checkpoint")
    else:
        d.event("Normal", "Restarting", f"{why}: restarting the training job; it resumes from the last "
                                        f"complete checkpoint")


def _stop_job(d: _Draft) -> None:
    """Every pod of the job deleted (with its grace period: a rank saves a shared checkpoint on
    SIGTERM), its groups Pending: planned again once the pods are gone."""
    everyone = sorted(set(d.groups) | set(d.pods))
    for r in everyone:
        d.act(DeleteGroup(r))
        d.pods[r] = []
    for r in everyone:
        if r >= max(d.desired, 1):    # paused (0 replicas): replica 0's record keeps the attempt count
            d.groups.pop(r, None)
            d.pods.pop(r, None)
    for r in range(d.desired):
        d.group(r)
    for g in d.groups.values():
        g.phase, g.last_failure, g.retry_at = GroupPhase.PENDING, None, None
    d.plan = None
    d.save()


def _grow_when_capacity_returns(d: _Draft) -> None:
    """A job running short (elastic) restarts wider once a wider plan fits. Nothing failed: no
    restart is counted; the new size is the largest that fits when the old pods are gone."""
    if d.plan is None or not elastic.may_grow(d.spec, d.desired, d.groups.values(), d.now):
        return
    try:
        facts = _model_facts(d)
        wider = facts and _plan_job(d, facts, above=d.desired)
    except planning.PlanFailure:
        return      # still short: go on at this size
    if not wider:
        return
    before, step = d.desired, int((d.state.status.get("training") or {}).get("step") or 0)
    _stop_job(d)
    d.event("Normal", "Growing", f"growing from {before} to {len(planned(wider))} replicas at step {step}: "
                                 f"the job stops (its ranks save a checkpoint) and resumes wider")


def _job_restart_reason(d: _Draft) -> str:
    """Why a running training job must restart whole (its world changes shape), or ""."""
    plan = d.stored
    ended = all(g.phase in (GroupPhase.SUCCEEDED, GroupPhase.FAILED) for g in d.groups.values())
    pods = [p for ps in d.pods.values() for p in ps if not p["metadata"].get("deletionTimestamp")]
    if plan is None or not pods or (d.groups and ended):
        return ""   # nothing runs (stopped already, or not started yet): nothing to restart
    if not planning.layout_matches(plan, d.spec):
        asked = planning.asked_shard(d.spec)
        zero = (f" ZeRO-3 shard {plan.data_shard}", f" ZeRO-3 shard {asked}") if asked else ("", "")
        context = d.spec.context_parallel()
        cp = (f" CP={plan.context}", f" CP={context}") if context != plan.context else ("", "")
        return (f"layout changed from TP={plan.tensor} PP={plan.pipeline}{zero[0]}{cp[0]} to "
                f"TP={d.spec.parallelism.tensor or 'auto'} PP={d.spec.parallelism.pipeline or 'auto'}{zero[1]}{cp[1]}")
    if planned(plan) != set(range(d.desired)):
        return f"replicas changed from {len(planned(plan))} to {d.desired}"
    for r, pods in d.pods.items():
        if _outdated_pods(pods, d.groups[r].attempt if r in d.groups else 0, d.state.spec_hash):
            return "spec changed"
    return ""


def _mark_old_layout_outdated(d: _Draft) -> None:
    """A served model asked for a new layout: the groups on the stored (old) layout keep serving,
    marked Outdated, and are replaced as spec.rollout says; the new layout's plan starts empty."""
    if d.stored is None or d.plan is not None:
        return
    newly = [r for r in sorted(planned(d.stored)) if r in d.groups and d.groups[r].phase not in (
        GroupPhase.FAILED, GroupPhase.PENDING, GroupPhase.OUTDATED)]
    for r in newly:
        d.groups[r].phase = GroupPhase.OUTDATED
    if newly:
        d.event("Normal", "LayoutChanged", f"rolling from TP={d.stored.tensor} PP={d.stored.pipeline} to the "
                                           f"spec's layout, as spec.rollout says")
        d.save()


def _scale_down(d: _Draft) -> None:
    """Replicas beyond the desired ones (and beyond a roll's surge replicas) are removed."""
    d.extent = d.desired + rollout.surge_slots(d)
    live = {r for r, pods in d.pods.items() if _live(pods)}
    extra = {r for r in set(d.groups) | live | planned(d.plan) if r >= d.extent and r >= 0}
    if d.workload.gang and d.desired == 0:
        extra = set()   # a paused job keeps its records (attempt numbers go on when it resumes)
    if not extra:
        return
    for r in sorted(extra):
        d.act(DeleteGroup(r))
        d.groups.pop(r, None)
        d.pods.pop(r, None)
    d.plan = drop_replicas(d.plan, extra)
    d.apply_shared(again=True)     # the stored plan forgets them
    d.save()
    d.event("Normal", "ScaledDown", f"removed replica(s) {sorted(extra)}")


# --- 4: judging each replica -----------------------------------------------------------------------

def _judge_groups(d: _Draft) -> None:
    job_step = _gang_step(d) if d.workload.gang else None
    # A finished job stays finished, whatever its replica count says now (more steps restart it).
    if d.workload.gang and finished(d.groups.values()):
        return
    for r in range(d.extent):
        if rollout.waits(d, r):
            continue
        g = d.group(r)
        if not _rolled_or_current(d, r):
            continue
        if d.plan is None or r not in planned(d.plan):
            if g.phase != GroupPhase.FAILED:
                d.replan.append(r)
            continue
        _judge(d, r, job_step)


def _rolled_or_current(d: _Draft, r: int) -> bool:
    """False while replica r waits its turn to be replaced (Outdated, or its pods run an old spec):
    spec.rollout's budgets say when (decide/rollout.py)."""
    if d.workload.gang or r >= d.desired or not rollout.is_old(d, r):
        return True
    why = rollout.may_take_down(d, r)
    if why is None:
        return False
    rollout.take_down(d, r, "layout" if d.groups[r].phase == GroupPhase.OUTDATED else "spec", why)
    return True


def _gang_step(d: _Draft) -> recovery.Step | None:
    """The one decision for a training job's replicas, from all their pods: None when the job is not
    planned whole (its replicas are then planned together)."""
    if d.plan is None or d.desired == 0 or not set(range(d.desired)) <= planned(d.plan) or \
            any(r not in d.groups for r in range(d.desired)):
        return None
    verdicts = [_assess(d, r) for r in range(d.desired)]
    return recovery.decide(d.groups[0], recovery.gang_verdict(verdicts), d.now, d.policy)


def _assess(d: _Draft, r: int) -> recovery.Verdict:
    assert d.plan is not None
    return recovery.assess(d.pods.get(r, []), d.groups[r].attempt, d.plan.pipeline, d.world.nodes, d.now,
                           d.policy, completes=d.workload.completes)


def _judge(d: _Draft, r: int, job_step: recovery.Step | None) -> None:
    before = d.groups[r].phase
    verdict = _assess(d, r)
    if job_step is not None:
        # the job's one decision, applied to this replica (events told once, for the job)
        step = dataclasses.replace(job_step, group=job_step.group.model_copy(update={"replica": r}),
                                   event=job_step.event if r == 0 else "")
    else:
        step = recovery.decide(d.groups[r], verdict, d.now, d.policy)
    d.groups[r] = step.group
    if step.event == "GroupReady":
        _note_recovered(d, r, before)
    if step.action in (StepAction.TEARDOWN, StepAction.FAIL):
        _tear_down(d, r, step)
    elif step.action == StepAction.REPLAN:
        d.replan.append(r)
    elif step.action == StepAction.CREATE:
        assert d.plan is not None
        d.apply_shared()
        d.act(CreatePods(r, step.group.attempt, d.plan, verdict.missing))
    elif step.requeue_after is not None:
        d.requeue_in(step.requeue_after)


def _note_recovered(d: _Draft, r: int, before: GroupPhase) -> None:
    g = d.groups[r]
    failed_at, g.failed_at = recovery.parse_iso(g.failed_at), None
    if failed_at and before in (GroupPhase.CREATING, GroupPhase.STARTING):
        seconds = (d.now - failed_at).total_seconds()
        d.recovered.append(seconds)
        d.event("Normal", "Recovered", f"{d.workload.who(r)} is {'running' if d.workload.gang else 'Ready'} "
                                       f"again after {seconds:.1f}s")


def _tear_down(d: _Draft, r: int, step: recovery.Step) -> None:
    """Delete the whole group; pods on a lost node are force-deleted (their kubelet will not answer)."""
    g = d.groups[r]
    d.act(DeleteGroup(r, force=_on_lost_nodes(d, d.pods.get(r, []))))
    d.pods[r] = []
    if step.action == StepAction.TEARDOWN:
        if step.event:
            d.recoveries.append(step.cause or "pod-failed")
            d.event("Warning", "Recovering", f"{d.workload.who(r)}: {step.reason}; "
                                             f"{d.workload.teardown_message(d.desired)} "
                                             f"(restart {g.restarts} of {d.policy.max_restarts})")
        if step.requeue_after is not None:
            d.requeue_in(step.requeue_after)
            if step.requeue_after <= 0:
                d.replan.append(r)
    elif step.event:
        d.event("Warning", "RestartBudgetExhausted", step.reason)
    d.save()


# --- 5: planning -----------------------------------------------------------------------------------

def _plan(d: _Draft) -> None:
    """Plan every group that needs it in one planner call, then store and create them."""
    for r in d.replan:
        if _live(d.pods.get(r, [])):
            d.act(DeleteGroup(r))
            d.pods[r] = []
    stopping = _previous_run_stopping(d) if d.workload.gang else 0
    if stopping:
        return _waiting_for_old_pods(d, stopping)
    try:
        facts = _model_facts(d)
        if facts is None:
            return _waiting_for_facts(d)
        new = _plan_job(d, facts) if d.workload.gang else _call_planner(d, facts)
    except planning.PlanFailure as e:
        return _cannot_plan(d, e)
    got = sorted(planned(new))
    if d.workload.gang:
        _resize_job(d, new)
    else:
        d.plan = merge_plan(d.plan, new, set(got))
    attempts = d.workload.attempts(d.groups[r] for r in got)
    for r in got:
        g = d.groups[r]
        g.phase, g.retry_at, g.attempt = GroupPhase.CREATING, None, attempts[r]
    for r in set(d.replan) - set(got):
        d.unplaced.append(r)
        d.groups[r].phase = GroupPhase.PENDING
        d.groups[r].last_failure = "not enough capacity for this replica (plan shrunk)"
    d.apply_shared(again=True)   # the plan is stored first: it is what the new pods read
    d.save()
    for r in got:
        d.act(CreatePods(r, d.groups[r].attempt, d.plan))
        d.event("Normal", "GroupCreated", _placement_line(d.plan, r, d.groups[r].attempt))


def _call_planner(d: _Draft, facts: ModelFacts) -> ShardPlan:
    current = planned(d.plan)
    keep = [r for r in range(d.extent) if r not in d.replan and r in current]
    previous = {r: [p.node for p in d.stored.stages_of(r)] for r in d.replan} if d.stored else {}
    started = time.monotonic()
    try:
        new = planning.plan_groups(d.spec, facts, d.state.namespace, d.state.name, d.world.nodes,
                                   d.world.gpu_pods, d.replan, d.plan, keep, previous, warm=d.warm)
    finally:
        d.plan_seconds = time.monotonic() - started
    return new


def _plan_job(d: _Draft, facts: ModelFacts, above: int = 0) -> ShardPlan | None:
    """A training job, whole, at the largest size it may run at (elastic.sizes) that fits; only sizes
    above `above` (None when none of those fits then). ShortOfCapacity when not even minReplicas fits."""
    first: planning.ShortOfCapacity | None = None
    started = time.monotonic()
    try:
        for n in (n for n in elastic.sizes(d.spec) if n > above):
            try:
                new = _plan_at(d, facts, n)
            except planning.ShortOfCapacity as e:
                first = first or e
                continue
            if first is None:
                return new
            note = elastic.shrunk_note(d.spec, n, str(first))
            return new.model_copy(update={"shrunk": True, "notes": [*new.notes, note]})
    finally:
        d.plan_seconds = time.monotonic() - started
    if above:
        return None
    floor = d.spec.min_replicas()
    more = f" (nor any size down to minReplicas {floor})" if floor < d.spec.parallelism.replicas else ""
    raise planning.ShortOfCapacity(f"{first}{more}")


def _plan_at(d: _Draft, facts: ModelFacts, n: int) -> ShardPlan:
    """The whole job planned at n replicas (all or nothing)."""
    replicas = list(range(n))
    previous = {r: [p.node for p in d.stored.stages_of(r)] for r in replicas} if d.stored else {}
    new = planning.plan_groups(elastic.at_size(d.spec, n), facts, d.state.namespace, d.state.name,
                               d.world.nodes, d.world.gpu_pods, replicas, None, [], previous, warm=d.warm)
    if planned(new) != set(replicas):
        raise planning.ShortOfCapacity(f"only {len(planned(new))} of the {n} replicas of the training job fit")
    return new


def _resize_job(d: _Draft, new: ShardPlan) -> None:
    """The job's records follow the size it was planned at (elastic: maybe fewer or more than before)."""
    size = len(planned(new))
    for r in [r for r in d.groups if r >= size]:
        d.groups.pop(r)
    for r in range(size):
        d.group(r)
    if size < d.spec.parallelism.replicas:
        d.event("Warning", "Shrunk", elastic.shrunk_reason(new))
    d.desired, d.replan, d.plan = size, list(range(size)), new


def _live(pods: Sequence[Mapping[str, Any]]) -> bool:
    return any(not p["metadata"].get("deletionTimestamp") for p in pods)


def _previous_run_stopping(d: _Draft) -> int:
    """Pods of the job's previous run that still exist (observed: deleted this pass, or stopping) on
    Ready nodes. Those on a lost node are force-deleted (their kubelet will not answer): not waited for."""
    stranded = _on_lost_nodes(d, [p for pods in d.state.pods.values() for p in pods])
    if stranded:
        d.act(DeletePods(stranded, force=True))
    return sum(len(pods) for pods in d.state.pods.values()) - len(stranded)


def _waiting_for_old_pods(d: _Draft, count: int) -> None:
    why = (f"waiting for the {count} pod(s) of the previous run to stop (a rank saves a "
           f"checkpoint on SIGTERM, within {renderer.grace_seconds(d.spec)}s)")
    for r in d.replan:
        d.groups[r].phase, d.groups[r].last_failure = GroupPhase.PENDING, why
    d.requeue_in(2.0)


def _cannot_plan(d: _Draft, error: planning.PlanFailure) -> None:
    message = str(error)
    invalid = isinstance(error, planning.InvalidSpec)
    d.unplaced += [] if invalid else d.replan
    for r in d.replan:
        g = d.groups[r]
        was = (g.phase, g.last_failure)
        g.phase, g.last_failure = GroupPhase.PENDING, None if invalid else message
        if not invalid and was != (g.phase, g.last_failure) and r < d.desired:   # a surge replica: rollout.py says
            d.event("Warning", "NoFeasiblePlan", f"replica {r}: {message}")
    if invalid:
        d.invalid = message
        said = condition(d.state.status.get("conditions"), "Planned") or {}
        if said.get("reason") != "InvalidSpec" or said.get("message") != message:
            d.event("Warning", "InvalidSpec", message)
    d.requeue_in(STEADY_REQUEUE if invalid else NOT_READY_REQUEUE * 2)


def _model_facts(d: _Draft) -> ModelFacts | None:
    """The model's shape: from hints or files the operator reads (observed), else what a probe pod read
    where the model lives (cached in status by uri), else None while the probe runs."""
    if d.state.local_facts is not None:
        return d.state.local_facts
    if d.state.facts_error:
        raise planning.InvalidSpec(d.state.facts_error)
    uri = d.spec.model.uri
    cached = d.facts if d.facts is not None and d.facts.uri == uri else None
    if cached is not None and cached.facts:
        try:   # the probe sized it for dtype auto; the spec may ask for another
            facts = ModelFacts.from_dict(cached.facts).for_dtype(d.spec.dtype)
            if not probe.out_of_bounds(facts):   # status is not the operator's alone to write
                return facts
        except ModelFactsError:
            pass
        cached = None          # written by another version, or out of bounds: read the model again
    if cached is not None and cached.error and cached.generation == d.state.generation:
        raise planning.InvalidSpec(cached.error)
    return _probe(d, uri, cached)


def _probe(d: _Draft, uri: str, cached: ModelFactsStatus | None) -> ModelFacts | None:
    """Read the model by a probe pod; None while it runs, or while the backoff after a transient
    failure (the store unreachable or busy) runs: such a failure is never the spec's error."""
    pod = d.state.probe_pod
    name = probe.pod_name(d.state.name, uri)
    if pod is not None and pod["metadata"].get("deletionTimestamp"):
        return None      # the last probe is going: its result is already recorded
    if probe.retry_pending(cached, d.state.generation, d.now):
        if pod is not None:
            d.act(DeletePods((pod["metadata"]["name"],)))
        return None
    if pod is None or pod["metadata"]["name"] != name:
        if pod is not None:
            d.act(DeletePods((pod["metadata"]["name"],)))
        d.act(CreateProbe())
        return None
    result = probe.result(pod)
    if result is None:
        return None
    d.act(DeletePods((name,)))
    if isinstance(result, ModelFacts):
        d.facts = ModelFactsStatus(uri=uri, facts=result.to_dict())
        return result.for_dtype(d.spec.dtype)
    if result.transient:
        d.facts = probe.unreached(uri, result.reason, cached, d.state.generation, d.now)
        d.event("Warning", "ModelUnreachable", f"{result.reason}; reading it again at {d.facts.retry_at}")
        return None
    d.facts = ModelFactsStatus(uri=uri, error=result.reason, generation=d.state.generation)
    raise planning.InvalidSpec(result.reason)


def _waiting_for_facts(d: _Draft) -> None:
    waiting = probe.retry_pending(d.facts, d.state.generation, d.now)   # the last probe is done with
    why = probe.waiting_message(None if waiting else d.state.probe_pod, d.state.name, d.spec.model.uri, d.facts)
    for r in d.replan:
        d.groups[r].phase, d.groups[r].last_failure = GroupPhase.PENDING, why
    d.requeue_in(NOT_READY_REQUEUE)


# --- 6: leftovers ----------------------------------------------------------------------------------

def _remove_leftovers(d: _Draft) -> None:
    """Pods of older attempts of a live group are leftovers of an interrupted teardown."""
    for r in range(d.extent):
        g = d.groups.get(r)
        if g is None:       # a finished training job scaled up: nothing was made for it
            continue
        if g.phase not in SETTLED:
            d.requeue_in(NOT_READY_REQUEUE)
        leftovers = tuple(p["metadata"]["name"] for p in d.pods.get(r, [])
                          if p["metadata"]["labels"].get(names.LABEL_ATTEMPT) != str(g.attempt)
                          and not p["metadata"].get("deletionTimestamp"))
        if leftovers:
            d.act(DeletePods(leftovers, force=True))


def _gate_on_prepull(d: _Draft) -> None:
    """spec.model.prePull: groups about to be created wait for their nodes' caches (decide/prepull.py)."""
    gated = prepull.gate(d.state, d.world.nodes, d.actions, d.now)
    d.actions, d.prepulling, d.prepull_note = gated.actions, gated.held, gated.note
    d.events += gated.events
    if gated.held:
        d.requeue_in(prepull.REQUEUE_SECONDS)


# --- helpers ----------------------------------------------------------------------------------------

def _on_lost_nodes(d: _Draft, pods: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Names of the pods on a lost node: force-deleted, since their kubelet will not answer."""
    return tuple(p["metadata"]["name"] for p in pods if recovery.on_lost_node(p, d.world.nodes))


def _placement_line(plan: ShardPlan, r: int, attempt: int) -> str:
    stages = ", ".join(f"s{p.stage}->{p.node}" for p in plan.stages_of(r))
    return f"replica {r} attempt {attempt}: {stages}"
