"""Reconcile one ShardedModel: read it, judge each replica group, act, write status.

Level-based and idempotent: everything it needs is read from the API server (the model and its pods)
or from the watched node inventory, and what it decided is written back into `status` before the
pods that depend on it are created. Any interruption leaves either nothing done or something a later
reconcile recognises (pods are named by replica, stage and attempt, and created with create-or-get).

Order of one pass:
  1. the model fresh from the API server; its pods (one list call)
  2. each replica group: recovery.assess its pods -> recovery.decide -> act
     (create missing pods / tear down / re-plan and recreate / give up)
  3. replicas beyond spec.parallelism.replicas: torn down (scale down)
  4. status (phase, conditions, groups, plan, counts) patched only when it changed; Events returned to
     the caller, which posts them.

Training jobs (`workload: training`) are one torch.distributed world over all their replicas, so
their replica groups are a gang: one verdict for all (the first failure tears every replica down),
one attempt number, planned together; a new layout, replica count or spec restarts the whole job,
which resumes from its latest complete checkpoint. Their status also carries the job's progress.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from shardwise.crds.models import PlanSummary, ShardedModelSpec, describe_validation_error
from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
from shardwise.operator import metrics, recovery, renderer, status as status_mod, training
from shardwise.operator.applier import Applier
from shardwise.operator.planning import PlanFailure, plan_groups

log = logging.getLogger("shardwise.operator")

NOT_READY_REQUEUE = 5.0     # seconds between passes while something is on its way
STEADY_REQUEUE = 30.0       # safety net when all is Ready (events wake us earlier)


@dataclasses.dataclass
class Event:
    type: str      # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass
class Outcome:
    phase: str = ""
    requeue_after: float = STEADY_REQUEUE
    events: list[Event] = dataclasses.field(default_factory=list)
    requests: int = 0
    body: dict | None = None


def plan_from_summary(summary: Mapping[str, Any] | None) -> ShardPlan | None:
    """Rebuild the ShardPlan from status.plan (layers "first-last", inclusive)."""
    if not summary or not summary.get("placements"):
        return None
    placements = []
    pipeline = int(summary["pipeline"])
    for p in summary["placements"]:
        first, _, last = str(p["layers"]).partition("-")
        placements.append(StagePlacement(replica=p["replica"], stage=p["stage"], node=p["node"], gpus=p["gpus"],
                                         layer_start=int(first), layer_end=int(last) + 1,
                                         embedding=p["stage"] == 0, head=p["stage"] == pipeline - 1))
    num_layers = max(p.layer_end for p in placements)
    replicas = sorted({p.replica for p in placements})
    return ShardPlan(tensor=int(summary["tensor"]), pipeline=pipeline, replicas=len(replicas),
                     num_layers=num_layers, placements=placements, cost=int(summary.get("cost", 0)),
                     shrunk=bool(summary.get("shrunk", False)),
                     groups=[ReplicaPlan(replica=r) for r in replicas])


def merge_plan(base: ShardPlan | None, new: ShardPlan, replicas: set[int]) -> ShardPlan:
    """`base` with the placements of `replicas` replaced by those in `new` (same layout)."""
    keep = [p for p in (base.placements if base else []) if p.replica not in replicas]
    placements = keep + [p for p in new.placements if p.replica in replicas]
    groups = [g for g in (base.groups if base else []) if g.replica not in replicas] + \
             [g for g in new.groups if g.replica in replicas]
    planned = {p.replica for p in placements}
    return ShardPlan(tensor=new.tensor, pipeline=new.pipeline, replicas=len(planned), num_layers=new.num_layers,
                     placements=placements, groups=sorted(groups, key=lambda g: g.replica),
                     cost=sum(g.cost for g in groups), shrunk=new.shrunk, notes=new.notes)


def drop_replicas(plan: ShardPlan | None, replicas: set[int]) -> ShardPlan | None:
    if plan is None:
        return None
    placements = [p for p in plan.placements if p.replica not in replicas]
    if not placements:
        return None
    groups = [g for g in plan.groups if g.replica not in replicas]
    return plan.model_copy(update={"placements": placements, "groups": groups,
                                   "replicas": len({p.replica for p in placements}),
                                   "cost": sum(g.cost for g in groups)})


def layout_matches(plan: ShardPlan, spec: ShardedModelSpec) -> bool:
    t, p = spec.parallelism.tensor, spec.parallelism.pipeline
    return (t is None or t == plan.tensor) and (p is None or p == plan.pipeline)


def reconcile(applier: Applier, namespace: str, name: str, nodes: Mapping[str, Mapping[str, Any]],
              capacity: Any, default_image: str = renderer.DEFAULT_IMAGE,
              now: Callable[[], datetime] = recovery.now_utc,
              progress: training.Fetch = training.fetch_progress) -> Outcome:
    """One pass over one ShardedModel. `capacity` (handlers.Capacity): live GPU pods of the cluster,
    reservations for pods just created, and the lock under which plans are made one at a time.
    `progress`: reads a running training pod's progress."""
    started, requests_before = time.monotonic(), applier.requests
    out = Outcome()
    body = applier.get_model(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return out
    try:
        _reconcile(applier, body, nodes, capacity, default_image, now(), out, progress)
    except Exception:
        metrics.RECONCILE_ERRORS.labels(namespace, name).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.labels(namespace, name).observe(time.monotonic() - started)
        out.requests = applier.requests - requests_before
    return out


def _reconcile(applier: Applier, body: dict, nodes: Mapping[str, Mapping[str, Any]],
               capacity: Any, default_image: str, now: datetime,
               out: Outcome, progress: training.Fetch) -> None:
    meta, old_status = body["metadata"], dict(body.get("status") or {})
    namespace, name = meta["namespace"], meta["name"]
    stamp = recovery.iso(now)
    conditions = list(old_status.get("conditions") or [])

    # What the schema could not catch ends in a condition, never in a crash loop.
    try:
        spec = ShardedModelSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        _finish_invalid(applier, body, old_status, f"invalid spec: {describe_validation_error(e)}", "InvalidSpec",
                        stamp, out)
        return
    policy = recovery.Policy.from_spec(body.get("spec"))
    desired = spec.parallelism.replicas
    gang = spec.workload == "training"   # replicas live and die together (one world)
    plan = plan_from_summary(old_status.get("plan"))
    groups = {int(g["replica"]): dict(g) for g in old_status.get("groups") or []}
    if old_status.get("observedGeneration") not in (None, meta.get("generation")):
        # A changed spec is a fresh start for groups that gave up (restart budget or invalid spec),
        # and for a finished training job asked for more steps than it did.
        more_steps = gang and spec.training.steps > int((old_status.get("training") or {}).get("steps") or 0)
        for g in groups.values():
            if g.get("phase") == recovery.FAILED or (more_steps and g.get("phase") == recovery.SUCCEEDED):
                g.update(phase=recovery.PENDING, restarts=0, lastFailure=None, retryAt=None)
    pods = applier.list_model_pods(namespace, name)
    pods_by_replica: dict[int, list[dict]] = {}
    for pod in pods:
        pods_by_replica.setdefault(int(pod["metadata"]["labels"].get(renderer.LABEL_REPLICA, -1)), []).append(pod)

    spec_hash = renderer.spec_hash(body.get("spec") or {}, default_image)
    if gang and plan is not None:
        why = _job_restart_reason(plan, spec, desired, groups, pods_by_replica, spec_hash)
        if why:
            _restart_job(applier, namespace, name, groups, pods_by_replica, desired, why, out)
            plan = None
    # A new layout (TP/PP) asked for: the plan becomes the target (empty at first); the groups on the
    # old layout keep serving, marked Outdated, and are replaced one at a time below.
    if plan is not None and not gang and not layout_matches(plan, spec):
        for r in _planned(plan):
            if r in groups and groups[r].get("phase") not in (recovery.FAILED, recovery.PENDING):
                groups[r]["phase"] = recovery.OUTDATED
        out.events.append(Event("Normal", "LayoutChanged",
                                f"rolling from TP={plan.tensor} PP={plan.pipeline} to the spec's layout, "
                                f"one replica at a time"))
        plan = None
        applier.patch_status(namespace, name, {"plan": None, "groups": [groups[r] for r in sorted(groups)]})
    shared_applied = False

    def ensure_shared(current: ShardPlan) -> None:
        nonlocal shared_applied
        for obj in renderer.render_shared(body, current):
            applier.apply(obj)
        shared_applied = True

    def write_plan_status(current: ShardPlan | None) -> None:
        """Persist the plan and group records before creating the pods that depend on them."""
        patch = {"plan": PlanSummary.from_plan(current).to_api() if current else None,
                 "groups": [groups[r] for r in sorted(groups)]}
        applier.patch_status(namespace, name, patch)

    invalid = ""
    # --- scale down: groups beyond the desired count go first --------------------------------
    extra = {r for r in set(groups) | set(pods_by_replica) | ({p.replica for p in plan.placements} if plan else set())
             if r >= desired and r >= 0}
    if gang and desired == 0:
        extra = set()   # a paused job keeps its records (attempt numbers go on when it resumes)
    if extra:
        for r in sorted(extra):
            applier.delete_group(namespace, name, r)
            groups.pop(r, None)
        plan = drop_replicas(plan, extra)
        write_plan_status(plan)
        out.events.append(Event("Normal", "ScaledDown", f"removed replica(s) {sorted(extra)}"))

    # --- each desired replica: judge, then act ------------------------------------------------
    replan: list[int] = []
    rolled = False
    job_step = _gang_step(groups, plan, pods_by_replica, desired, nodes, now, policy) if gang else None
    # A finished job stays finished, whatever its replica count says now (more steps restart it).
    job_finished = gang and bool(groups) and all(g.get("phase") == recovery.SUCCEEDED for g in groups.values())
    for r in range(0 if job_finished else desired):
        g = groups.setdefault(r, {"replica": r, "attempt": 0, "phase": recovery.PENDING, "restarts": 0})
        if g.get("phase") == recovery.OUTDATED:
            # On the old layout: replaced when every other replica serves (or it is the only one).
            if not rolled and _others_serving(groups, r, desired):
                rolled = True
                g.update(phase=recovery.PENDING, lastFailure=None)
                out.events.append(Event("Normal", "Rolling", f"replacing replica {r} with the new layout"))
            else:
                continue
        elif plan is not None and r in _planned(plan) and g.get("phase") == recovery.READY and \
                _outdated_pods(pods_by_replica.get(r, []), int(g.get("attempt", 0)), spec_hash):
            # Same layout, new model/image/resources: replaced the same way, one replica at a time.
            if not rolled and _others_serving(groups, r, desired):
                rolled = True
                applier.delete_group(namespace, name, r)
                pods_by_replica[r] = []
                plan = drop_replicas(plan, {r})
                g.update(phase=recovery.PENDING, lastFailure=None)
                out.events.append(Event("Normal", "Rolling", f"replacing replica {r} with the new spec"))
            else:
                continue
        if plan is None or r not in _planned(plan):
            if g.get("phase") != recovery.FAILED or g.get("lastFailure", "").startswith("invalid"):
                replan.append(r)
            continue
        verdict = recovery.assess(pods_by_replica.get(r, []), int(g.get("attempt", 0)), plan.pipeline, nodes,
                                  now, policy, completes=gang)
        before = g.get("phase")
        if job_step is not None:
            # the job's one decision, applied to this replica (events told once, for the job)
            step = dataclasses.replace(job_step, group={**job_step.group, "replica": r},
                                       event=job_step.event if r == 0 else "")
        else:
            step = recovery.decide(g, verdict, now, policy)
        g = groups[r] = step.group
        who = "training job" if gang else f"replica {r}"
        if (job_step or step).event == "GroupReady":
            failed_at = recovery.parse_iso(g.pop("failedAt", None))
            if failed_at and before in (recovery.CREATING, recovery.STARTING) and step.event:
                metrics.RECOVERY_SECONDS.labels(namespace, name).observe((now - failed_at).total_seconds())
                out.events.append(Event("Normal", "Recovered", f"{who} is {'running' if gang else 'Ready'} again "
                                                               f"after {(now - failed_at).total_seconds():.1f}s"))
        if step.action in ("teardown", "fail"):
            _teardown(applier, namespace, name, r, pods_by_replica.get(r, []), nodes)
            pods_by_replica[r] = []
            if step.action == "teardown":
                if step.event:
                    metrics.RECOVERIES.labels(namespace, name, metrics.cause_of(step.reason)).inc()
                    what = (f"tearing down all {desired} replicas; it resumes from the last complete checkpoint"
                            if gang else "tearing the group down")
                    out.events.append(Event("Warning", "Recovering",
                                            f"{who}: {step.reason}; {what} "
                                            f"(restart {g['restarts']} of {policy.max_restarts})"))
                if step.requeue_after is not None:
                    out.requeue_after = min(out.requeue_after, max(0.2, step.requeue_after))
            elif step.event:
                out.events.append(Event("Warning", "RestartBudgetExhausted", step.reason))
            write_plan_status(plan)
            if step.action == "teardown" and step.requeue_after is not None and step.requeue_after <= 0:
                replan.append(r)
        elif step.action == "replan":
            replan.append(r)
        elif step.action == "create":
            if not shared_applied:
                ensure_shared(plan)
            _create_pods(applier, capacity, body, plan, r, int(g["attempt"]), default_image,
                         only=set(verdict.missing))
        elif step.requeue_after is not None:
            out.requeue_after = min(out.requeue_after, max(0.2, step.requeue_after))

    # --- (re)plan the groups that need it, all in one planner call ------------------------------
    if replan:
        keep = [r for r in range(desired) if r not in replan and plan is not None and r in _planned(plan)]
        previous = {r: [p.node for p in plan.stages_of(r)] for r in replan} if plan is not None else {}
        for r in replan:
            if pods_by_replica.get(r):
                applier.delete_group(namespace, name, r)
        try:
            with capacity.lock:
                started = time.monotonic()
                try:
                    new = plan_groups(spec, namespace, name, nodes, capacity.pods(set()), replan, plan, keep,
                                      previous)
                finally:
                    metrics.PLAN_SECONDS.observe(time.monotonic() - started)
                got = sorted(_planned(new))
                if gang and got != sorted(replan):
                    raise PlanFailure(f"only {len(got)} of the {len(replan)} replicas of the training job fit; "
                                      f"it runs with all of them or waits", invalid=False)
                plan = merge_plan(plan if plan is not None and layout_matches(plan, spec) else
                                  drop_replicas(plan, set(replan)), new, set(got))
                # A new attempt on every (re)plan: new pod names, nothing waits for the old pods. A
                # training job's replicas share one (their rendezvous port depends on it).
                shared_attempt = max((int(groups[r].get("attempt", 0)) for r in got), default=0) + 1
                for r in got:
                    groups[r].update(phase=recovery.CREATING, retryAt=None,
                                     attempt=shared_attempt if gang else int(groups[r].get("attempt", 0)) + 1)
                    for pod in renderer.render_replica_pods(body, plan, r, groups[r]["attempt"], default_image):
                        capacity.reserve(pod, plan.placement(r, int(pod["metadata"]["labels"][renderer.LABEL_STAGE])).node)
            for r in set(replan) - set(got):
                groups[r].update(phase=recovery.PENDING, lastFailure="not enough capacity for this replica "
                                                                    "(plan shrunk)")
            write_plan_status(plan)
            ensure_shared(plan)
            for r in got:
                _create_pods(applier, capacity, body, plan, r, int(groups[r]["attempt"]), default_image)
                out.events.append(Event("Normal", "GroupCreated", _placement_line(plan, r, int(groups[r]["attempt"]))))
        except PlanFailure as e:
            if e.invalid:
                invalid = f"invalid: {e}"
            for r in replan:
                g = groups[r]
                was = (g.get("phase"), g.get("lastFailure"))
                g.update(phase=recovery.FAILED if e.invalid else recovery.PENDING,
                         lastFailure=f"invalid: {e}" if e.invalid else str(e))
                if was != (g["phase"], g["lastFailure"]):
                    out.events.append(Event("Warning", "InvalidSpec" if e.invalid else "NoFeasiblePlan",
                                            f"replica {r}: {e}"))
            out.requeue_after = min(out.requeue_after, STEADY_REQUEUE if e.invalid else NOT_READY_REQUEUE * 2)

    for r in range(desired):
        g = groups.get(r)
        if g is None:       # a finished training job scaled up: nothing was made for it
            continue
        if g.get("phase") not in (recovery.READY, recovery.FAILED, recovery.SUCCEEDED, recovery.PENDING,
                                  recovery.RECOVERING):
            out.requeue_after = min(out.requeue_after, NOT_READY_REQUEUE)
        # Pods of older attempts of a live group are leftovers of an interrupted teardown.
        leftovers = [p["metadata"]["name"] for p in pods_by_replica.get(r, [])
                     if p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) != str(g.get("attempt", 0))
                     and not p["metadata"].get("deletionTimestamp")]
        if leftovers:
            applier.delete_pods(namespace, leftovers, force=True)

    # --- status ----------------------------------------------------------------------------------
    live = [groups[r] for r in sorted(groups) if r < desired]
    ready_shards = 0
    if plan is not None:
        for r in range(desired):
            attempt = str(groups.get(r, {}).get("attempt", 0))
            ready_shards += sum(recovery.pod_ready(p) for p in pods_by_replica.get(r, [])
                                if p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == attempt)
    phase = status_mod.model_phase(live, desired, invalid)
    ready_replicas = sum(g.get("phase") in (recovery.READY, recovery.OUTDATED) for g in live)
    message = status_mod.phase_message(live, desired, invalid, job=gang)
    job: dict = {}
    if gang:
        if job_finished:
            phase = status_mod.SUCCEEDED
        elif desired == 0:   # scaled to zero: paused, not done
            phase, message = status_mod.PENDING, "paused at 0 replicas; scale up to resume from the last checkpoint"
        elif phase == status_mod.READY:
            phase = status_mod.RUNNING
        job = _job_status(spec, plan, groups, pods_by_replica, desired, progress)
        if phase == status_mod.RUNNING:
            out.requeue_after = min(out.requeue_after, training.POLL_SECONDS)
        done = job.get("training") or old_status.get("training")
        if done and done.get("steps"):
            message += f"; step {done.get('step', 0)} of {done['steps']}"
    conditions = status_mod.set_condition(
        conditions, "Planned", plan is not None and not invalid and all(g.get("phase") != recovery.PENDING for g in live),
        "InvalidSpec" if invalid else ("Planned" if plan is not None and all(g.get("phase") != recovery.PENDING for g in live)
                                       else "NoFeasiblePlan"),
        invalid or (next((g["lastFailure"] for g in live if g.get("phase") == recovery.PENDING and g.get("lastFailure")),
                         None) or (f"TP={plan.tensor} PP={plan.pipeline} cost={plan.cost}" if plan else "not planned")),
        stamp)
    conditions = status_mod.set_condition(conditions, "Ready", phase in (status_mod.READY, status_mod.RUNNING),
                                          phase, message, stamp)
    # Gang scheduling: a group is only as scheduled as its least lucky pod; say why, in the
    # scheduler's words, while we wait (after the grace period the group is re-planned).
    unscheduled = []
    for r in range(desired):
        attempt = str(groups.get(r, {}).get("attempt", 0))
        for p in pods_by_replica.get(r, []):
            why = recovery.unschedulable_message(p)
            if why and p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == attempt:
                unscheduled.append(f"pod {p['metadata']['name']}: {why}")
    conditions = status_mod.set_condition(
        conditions, "PodsScheduled", not unscheduled, "Unschedulable" if unscheduled else "Scheduled",
        "; ".join(unscheduled) or "every pod of the plan is placed or on its way", stamp)
    recovering = [g for g in live if g.get("phase") == recovery.RECOVERING]
    conditions = status_mod.set_condition(
        conditions, "Recovering", bool(recovering), "GroupFailed" if recovering else "Healthy",
        "; ".join(f"replica {g['replica']}: {g.get('lastFailure')}" for g in recovering) or "no group is recovering",
        stamp)
    port = spec.serving.port
    restarts = [int(g.get("restarts", 0)) for g in groups.values()]
    new_status = {
        "phase": phase, "message": message, "conditions": conditions,
        "observedGeneration": meta.get("generation"),
        # a training job's replicas restart together: one restart of the job, not one per replica
        "restarts": max(restarts, default=0) if gang else sum(restarts),
        "tensor": plan.tensor if plan else None, "pipeline": plan.pipeline if plan else None,
        "replicas": len({p.replica for p in plan.placements}) if plan else 0,
        "readyReplicas": ready_replicas, "readyShards": ready_shards,
        "selector": f"{renderer.LABEL_MODEL}={name},{renderer.LABEL_STAGE}=0",
        "endpoint": renderer.endpoint(name, namespace, port) if plan and not gang else None,
        "plan": PlanSummary.from_plan(plan).to_api() if plan else None,
        "groups": [groups[r] for r in sorted(groups)],
        **job,
    }
    old_phase = old_status.get("phase")
    if phase != old_phase:
        out.events.append(Event("Warning" if phase in (status_mod.FAILED, status_mod.DEGRADED, status_mod.RECOVERING)
                                else "Normal", phase, message))
    if _differs(old_status, new_status):
        applier.patch_status(namespace, name, new_status)
    out.phase = phase
    if plan is not None:
        metrics.SHARDS_DESIRED.labels(namespace, name).set(desired * plan.pipeline)
        metrics.PLAN_COST.labels(namespace, name).set(plan.cost)
    metrics.SHARDS_READY.labels(namespace, name).set(ready_shards)
    if job:
        metrics.TRAINING_STEP.labels(namespace, name).set(job["training"]["step"])
        last = recovery.parse_iso((job.get("lastCheckpoint") or {}).get("time"))
        if last is not None:
            metrics.CHECKPOINT_STEP.labels(namespace, name).set(job["lastCheckpoint"]["step"])
            metrics.CHECKPOINT_TIME.labels(namespace, name).set(last.timestamp())
    metrics.REPLICAS_READY.labels(namespace, name).set(ready_replicas)


def _job_restart_reason(plan: ShardPlan, spec: ShardedModelSpec, desired: int, groups: Mapping[int, dict],
                        pods_by_replica: Mapping[int, list[dict]], spec_hash: str) -> str:
    """Why a planned training job must restart whole (its world changes shape), or ""."""
    if all(g.get("phase") in (recovery.SUCCEEDED, recovery.FAILED) for g in groups.values()) and groups:
        return ""
    if not layout_matches(plan, spec):
        return (f"layout changed from TP={plan.tensor} PP={plan.pipeline} to "
                f"TP={spec.parallelism.tensor or 'auto'} PP={spec.parallelism.pipeline or 'auto'}")
    if _planned(plan) != set(range(desired)):
        return f"replicas changed from {len(_planned(plan))} to {desired}"
    for r, pods in pods_by_replica.items():
        if _outdated_pods(pods, int(groups.get(r, {}).get("attempt", 0)), spec_hash):
            return "spec changed"
    return ""


def _restart_job(applier: Applier, namespace: str, name: str, groups: dict[int, dict],
                 pods_by_replica: dict[int, list[dict]], desired: int, why: str, out: Outcome) -> None:
    """Tear a training job down whole and leave every replica to be planned again (no restart is
    counted: nothing failed); the caller drops the plan."""
    for r in sorted(set(groups) | set(pods_by_replica)):
        applier.delete_group(namespace, name, r)
        pods_by_replica[r] = []
    for r in [r for r in set(groups) | set(pods_by_replica) if r >= max(desired, 1)]:
        groups.pop(r, None)       # paused (0 replicas): replica 0's record keeps the attempt count
        pods_by_replica.pop(r, None)
    for r in range(desired):
        groups.setdefault(r, {"replica": r, "attempt": 0, "restarts": 0})
    for g in groups.values():
        g.update(phase=recovery.PENDING, lastFailure=None, retryAt=None)
    applier.patch_status(namespace, name, {"plan": None, "groups": [groups[r] for r in sorted(groups)]})
    if desired == 0:
        out.events.append(Event("Normal", "Paused", f"{why}: the training job is stopped; scaled up again, it "
                                                    f"resumes from the last complete checkpoint"))
    else:
        out.events.append(Event("Normal", "Restarting", f"{why}: restarting the training job with all "
                                                        f"{desired} replicas; it resumes from the last complete checkpoint"))


def _gang_step(groups: Mapping[int, dict], plan: ShardPlan | None, pods_by_replica: Mapping[int, list[dict]],
               desired: int, nodes: Mapping[str, Mapping[str, Any]], now: datetime,
               policy: recovery.Policy) -> recovery.Step | None:
    """The one decision for a training job's replicas, from all their pods: None when the job is
    not planned (its replicas are then planned together)."""
    if plan is None or desired == 0 or not set(range(desired)) <= _planned(plan) or \
            any(r not in groups for r in range(desired)):
        return None
    verdicts = [recovery.assess(pods_by_replica.get(r, []), int(groups[r].get("attempt", 0)), plan.pipeline,
                                nodes, now, policy, completes=True) for r in range(desired)]
    return recovery.decide(groups[0], recovery.gang_verdict(verdicts), now, policy)


def _job_status(spec: ShardedModelSpec, plan: ShardPlan | None, groups: Mapping[int, dict],
                pods_by_replica: Mapping[int, list[dict]], desired: int, fetch: training.Fetch) -> dict:
    """status.training and status.lastCheckpoint from the job's current pods ({} when none reports)."""
    current = [p for r in range(desired) for p in pods_by_replica.get(r, [])
               if p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == str(groups.get(r, {}).get("attempt", 0))]
    found = training.job_progress(current, fetch) if plan is not None else None
    return training.status_fields(found, spec.checkpoint.path) if found else {}


def _planned(plan: ShardPlan | None) -> set[int]:
    return {p.replica for p in plan.placements} if plan is not None else set()


def _others_serving(groups: Mapping[int, Mapping[str, Any]], r: int, desired: int) -> bool:
    """A rolling replacement of replica r keeps at least one other replica serving (when there are two+)."""
    if desired < 2:
        return True
    return all(groups.get(o, {}).get("phase") in (recovery.READY, recovery.OUTDATED)
               for o in range(desired) if o != r)


def _outdated_pods(pods: list[dict], attempt: int, spec_hash: str) -> bool:
    live = [p for p in pods if p["metadata"]["labels"].get(renderer.LABEL_ATTEMPT) == str(attempt)]
    return any(p["metadata"]["labels"].get(renderer.LABEL_SPEC_HASH) not in (None, spec_hash) for p in live)


def _differs(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(old.get(k) != v for k, v in new.items())


def _placement_line(plan: ShardPlan, r: int, attempt: int) -> str:
    stages = ", ".join(f"s{p.stage}->{p.node}" for p in plan.stages_of(r))
    return f"replica {r} attempt {attempt}: {stages}"


def _teardown(applier: Applier, namespace: str, name: str, r: int, pods: list[dict],
              nodes: Mapping[str, Mapping[str, Any]]) -> None:
    """Delete the whole group; pods on a lost node are force-deleted (their kubelet will not answer)."""
    applier.delete_group(namespace, name, r)
    lost = [p["metadata"]["name"] for p in pods
            if p.get("spec", {}).get("nodeName") and not recovery.node_ready(nodes.get(p["spec"]["nodeName"]))]
    if lost:
        applier.delete_pods(namespace, lost, force=True)


def _create_pods(applier: Applier, capacity: Any, body: Mapping[str, Any], plan: ShardPlan, r: int,
                 attempt: int, default_image: str, only: set[int] | None = None) -> None:
    """Gang creation: every pod of the group in one pass (create-or-get, so a repeat is harmless)."""
    for pod in renderer.render_replica_pods(body, plan, r, attempt, default_image):
        stage = int(pod["metadata"]["labels"][renderer.LABEL_STAGE])
        if only is not None and stage not in only:
            continue
        capacity.reserve(pod, plan.placement(r, stage).node)
        applier.create_pod(pod)


def _finish_invalid(applier: Applier, body: dict, old_status: dict, message: str, reason: str, stamp: str,
                    out: Outcome) -> None:
    meta = body["metadata"]
    conditions = status_mod.set_condition(old_status.get("conditions"), "Planned", False, reason, message, stamp)
    conditions = status_mod.set_condition(conditions, "Ready", False, status_mod.FAILED, message, stamp)
    new = {"phase": status_mod.FAILED, "message": message, "conditions": conditions,
           "observedGeneration": meta.get("generation")}
    if old_status.get("phase") != status_mod.FAILED:
        out.events.append(Event("Warning", reason, message))
    if _differs(old_status, new):
        applier.patch_status(meta["namespace"], meta["name"], new)
    out.phase = status_mod.FAILED
