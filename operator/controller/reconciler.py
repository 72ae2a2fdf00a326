"""Reconcile one ShardedModel: observe -> decide -> act -> report.

    observe  state.observe: the model (typed spec, status records), its pods and its stored plan
    decide   decisions.decide: pure; the actions, group records, plan and Events of this pass
    act      run the actions in order through the applier (the only module that talks to the API)
    report   decide/status.py build_status (pure): status patched when it changed; Events returned
             to the caller; report.record_metrics sets the metrics

Level-based and idempotent: everything it needs is read from the API server or from the watched
node and pod inventory, and what it decided is stored (plan ConfigMap, then group records) before the
pods that depend on it are created. Plans are made one model at a time: `decide` runs under the
capacity lock, and the GPUs of the pods it creates are reserved before the lock is released.

Status writes are conditional on the model's resourceVersion as this pass read (or last wrote) it:
when the model changed meanwhile (a spec edit, or a newer leader's write after this process was
paused) the patch is refused and the pass ends; the next one, moments later, reads it again.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from datetime import datetime
from typing import Any, Callable, Mapping

from shardwise.crds import names
from shardwise.crds.models import ModelCache, ModelPhase, PlanSummary
from shardwise.crds.status import group_records
from shardwise.operator.decide import conditions, decisions
from shardwise.operator.controller import metrics
from shardwise.operator.decide import probe
from shardwise.operator.decide import recovery
from shardwise.operator.decide import status
from shardwise.operator.render import prepull, renderer, source
from shardwise.operator.controller import report
from shardwise.operator.controller import download
from shardwise.operator.controller.inferencepool import POOLS
from shardwise.operator.controller.routers import ROUTERS
from shardwise.operator.controller import progress as training
from shardwise.operator.controller.apply import Applier, ObjectConflict, PodRefused, StaleStatus, any_refusal
from shardwise.operator.decide.decisions import Decision, Event, World
from shardwise.operator.controller.observe import observe
from shardwise.operator.decide.state import ModelState

log = logging.getLogger("shardwise.operator")

__all__ = ["Event", "Outcome", "reconcile", "act"]
STALE_REQUEUE = 0.5     # seconds before a pass whose status write was refused reads the model again


@dataclasses.dataclass
class Outcome:
    phase: str = ""
    requeue_after: float = decisions.STEADY_REQUEUE
    events: list[Event] = dataclasses.field(default_factory=list)
    requests: int = 0


def reconcile(applier: Applier, namespace: str, name: str, nodes: Mapping[str, Mapping[str, Any]],
              capacity: Any, default_image: str = renderer.DEFAULT_IMAGE,
              now: Callable[[], datetime] = recovery.now_utc,
              progress: training.Fetch = training.fetch_progress,
              downloads: download.Fetch = download.fetch_download) -> Outcome:
    """One pass over one ShardedModel. `capacity` (handlers.Capacity): live GPU pods of the cluster,
    reservations for pods just created, and the lock under which plans are made one at a time.
    `progress`: reads a running training pod's progress; `downloads`: a fetching pod's download."""
    started, requests_before = time.monotonic(), applier.requests
    out = Outcome()
    try:
        state = observe(applier, namespace, name, default_image)
        if state is None:
            metrics.forget(namespace, name)
            POOLS.forget(namespace, name)
            ROUTERS.forget(namespace, name)
            return out
        with capacity.lock:
            decision = decisions.decide(state, World(nodes, capacity.pods(set())), now())
            _reserve(capacity, state, decision)
        writer = StatusWriter(applier, state)
        try:
            act(applier, state, decision, writer)
        except ObjectConflict as e:
            _conflict(writer, state, str(e), now(), out)
            return out
        except PodRefused as e:
            _conflict(writer, state, refused_message(state, str(e)), now(), out, reason="PodRefused")
            return out
        if decision.plan is not None:
            POOLS.ensure(applier, state)     # the inference gateway's pool, when the cluster has the API
        ROUTERS.ensure(applier, state)       # the model's router, when spec.serving.router asks for one
        _report(writer, state, decision, (progress, downloads), now(), out)
    except StaleStatus as e:
        log.info(f"{e}; reading it again")
        out.requeue_after = STALE_REQUEUE
    except Exception:
        metrics.RECONCILE_ERRORS.labels(namespace, name).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.labels(namespace, name).observe(time.monotonic() - started)
        out.requests = applier.requests - requests_before
    return out


class StatusWriter:
    """The status writes of one pass, each conditional on the version of the model it last read or
    wrote (StaleStatus when someone else wrote it in between)."""

    def __init__(self, applier: Applier, state: ModelState):
        self.applier, self.namespace, self.name = applier, state.namespace, state.name
        self.version = state.version

    def patch(self, status: Mapping[str, Any]) -> None:
        stored = self.applier.patch_status(self.namespace, self.name, status, self.version)
        if stored is not None:
            self.version = stored["metadata"]["resourceVersion"]


def _conflict(writer: StatusWriter, state: ModelState, message: str, now: datetime, out: Outcome,
              reason: str = "ObjectConflict") -> None:
    """An object the model would make belongs to someone else (ObjectConflict), or admission refused
    one of its pods (PodRefused): said in the Applied condition and an Event; tried again at the
    steady pace (someone may remove or rename it, or change the spec or the namespace)."""
    said = conditions.condition(state.status.get("conditions"), "Applied") or {}
    if said.get("reason") != reason or said.get("message") != message:
        out.events.append(Event("Warning", reason, message))
        writer.patch({
            "message": message,
            "conditions": conditions.set_condition(state.status.get("conditions"), "Applied", False,
                                                   reason, message, recovery.iso(now))})
    out.requeue_after = decisions.STEADY_REQUEUE


def refused_message(state: ModelState, refusal: str) -> str:
    """Admission's refusal of a pod, with what to change when it is the node cache's hostPath."""
    model = state.model
    cache_volume = f'"{source.VOLUME}"'   # admission names the volumes it refuses
    if model is not None and cache_volume in refusal and model.spec.model.remote_scheme() and (
            model.spec.model.cache in (None, ModelCache.NODE)):
        return (f"{refusal}; a model fetched from {model.spec.model.remote_scheme()}:// in a namespace that "
                f"enforces Pod Security baseline or restricted needs spec.model.cache: pod")
    return refusal


def _reserve(capacity: Any, state: ModelState, decision: Decision) -> None:
    """The GPUs of the pods about to be created, counted before the next model plans (the watch
    lags behind our own creates); and of the groups waiting for their pre-pull, renewed every pass
    while they wait, so that their planned GPUs are not handed to another model meanwhile."""
    for create in [*decision.new_pods(), *decision.prepulling]:
        for pod in _pods(state, create):
            stage = int(pod["metadata"]["labels"][names.LABEL_STAGE])
            capacity.reserve(pod, create.plan.placement(create.replica, stage).node)


def _pods(state: ModelState, create: decisions.CreatePods) -> list[dict]:
    assert state.model is not None
    pods = renderer.render_replica_pods(state.model, create.plan, create.replica, create.attempt,
                                        state.default_image)
    if create.stages is None:
        return pods
    return [p for p in pods if int(p["metadata"]["labels"][names.LABEL_STAGE]) in create.stages]


@functools.singledispatch
def _run(action: Any, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    raise TypeError(f"no way to run {action!r}")


@_run.register
def _(action: decisions.DeleteGroup, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    assert state.model is not None
    applier.delete_group(state.namespace, state.name, action.replica, state.model.metadata["uid"])
    if action.force:
        applier.delete_pods(state.namespace, list(action.force), force=True)


@_run.register
def _(action: decisions.DeletePods, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    applier.delete_pods(state.namespace, list(action.names), force=action.force)


@_run.register
def _(action: decisions.ApplyShared, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    assert state.model is not None
    for obj in renderer.render_shared(state.model, action.plan):
        applier.apply(obj)


@_run.register
def _(action: decisions.SaveGroups, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    plan = action.plan if action.plan is not None and action.plan.placements else None
    writer.patch({
        "plan": PlanSummary.from_plan(plan).to_api() if plan else None,
        "groups": group_records(action.groups)})


@_run.register
def _(action: decisions.CreatePods, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    # Gang creation: every pod of the group in one pass (create-or-get, so a repeat is harmless).
    for pod in _pods(state, action):
        applier.create_pod(pod)


@_run.register
def _(action: decisions.CreatePrePull, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    assert state.model is not None
    try:
        for node in action.nodes:
            applier.create_pod(prepull.render(state.model, action.plan, action.replica, action.attempt, node,
                                              state.default_image), refusals=any_refusal)
    except PodRefused as e:
        # A pre-pull never blocks serving: any refusal of its pod (a quota, an admission policy the
        # worker pods meet) starts the group's own pods, which fetch their files themselves.
        _run(action.group, applier, state, writer)
        raise PodRefused(f"a pre-pull pod was refused ({e}); replica {action.replica}'s pods were created "
                         f"without a pre-pull") from None


@_run.register
def _(action: decisions.CreateProbe, applier: Applier, state: ModelState, writer: StatusWriter) -> None:
    assert state.model is not None
    applier.create_pod(probe.render(state.model, state.default_image))


def act(applier: Applier, state: ModelState, decision: Decision, writer: StatusWriter | None = None) -> None:
    """Run the decision's actions in order: each is idempotent, so an interrupted pass is redone."""
    writer = writer or StatusWriter(applier, state)
    for action in decision.actions:
        _run(action, applier, state, writer)


def _report(writer: StatusWriter, state: ModelState, decision: Decision,
            fetch: tuple[training.Fetch, download.Fetch], now: datetime, out: Outcome) -> None:
    job = _job_progress(state, decision, fetch[0])
    new = status.build_status(state, decision, job, now)
    downloaded = download.apply(new, state, decision, fetch[1], now)   # a remote model's fetch
    event = status.phase_event(state, new)
    out.events = decision.events + ([event] if event else [])
    out.phase = new["phase"]
    out.requeue_after = decision.requeue_after
    if new["phase"] == ModelPhase.RUNNING or new.get("download"):
        out.requeue_after = min(out.requeue_after, training.POLL_SECONDS)
    if status.changed(state.status, new):
        writer.patch(new)
    out.events += downloaded    # once status.groups says they are posted: a failed write posts none
    report.record_metrics(state, decision, new, now)


def _job_progress(state: ModelState, decision: Decision, fetch: training.Fetch) -> dict:
    """status.training and status.lastCheckpoint from the job's current pods ({} when none reports)."""
    if state.model is None or not state.workload.gang or decision.plan is None:
        return {}
    current = [p for r in range(decision.size or 0) for p in state.pods.get(r, [])
               if r in decision.groups
               and p["metadata"]["labels"].get(names.LABEL_ATTEMPT) == str(decision.groups[r].attempt)]
    found = training.job_progress(current, fetch)
    return training.status_fields(found, state.spec.checkpoint) if found else {}
