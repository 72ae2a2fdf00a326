"""A serving model's roll (spec.rollout, crds/rollout.py): which replicas run beside the desired ones
while it lasts, and which old replica may be taken down now. Pure; decisions.py asks it.

A replica is old while its group is Outdated (a new layout) or its pods carry another spec hash (a
new image or spec). While any desired replica is old, or not yet Ready after its replacement, the
model has `maxSurge` surge replicas numbered after the desired ones (desired..desired+maxSurge-1),
planned and created with the new spec like any replica; once every desired replica runs the new
spec and none is on its way (a Failed one does not hold them) they are removed
(decisions._scale_down). They are removed at once when a desired replica's successor finds no room:
their GPUs are what it needs, and the roll goes on in place. Surge replicas are only started while
no desired replica is being replaced in place, so they never race a replacement for the GPUs it
freed.

An old replica is taken down when that leaves at least `desired - maxUnavailable` replicas serving
(Ready or Outdated, surge replicas counted). A full cluster has no room for a surge replica: its
record then stays Pending with the planner's reason, it is not tried again in this roll, and when
nothing else can move one old replica is taken down anyway while every other replica serves (its
Rolling Event says why): the roll never waits for capacity the old replicas hold.
"""
from __future__ import annotations

from typing import Any

from shardwise.crds import names
from shardwise.crds.models import GroupPhase, ReplicaGroupStatus
from shardwise.operator.decide.actions import DeleteGroup
from shardwise.operator.planning.groups import drop_replicas, planned

SERVING = (GroupPhase.READY, GroupPhase.OUTDATED)
ON_ITS_WAY = (GroupPhase.PENDING, GroupPhase.CREATING, GroupPhase.STARTING, GroupPhase.RECOVERING)
FULL = "no room for a surge replica"


def surge_slots(d: Any) -> int:
    """How many surge replicas the model has in this pass (0 when no roll is under way)."""
    if d.workload.gang or d.desired == 0:
        return 0
    groups = [d.groups[r] for r in range(d.desired) if r in d.groups]
    if any(g.phase == GroupPhase.PENDING and g.last_failure for g in groups):
        return 0    # a successor found no room: the surge replicas' GPUs are what it needs
    rolling = any(is_old(d, g.replica) for g in groups)
    started = any(r >= d.desired for r in d.groups)
    on_its_way = len(groups) < d.desired or any(g.phase in ON_ITS_WAY for g in groups)
    return d.spec.rollout.max_surge if rolling or (started and on_its_way) else 0


def is_old(d: Any, r: int) -> bool:
    """Replica r runs an old layout or spec and waits its turn to be replaced."""
    g = d.groups[r]
    return g.phase == GroupPhase.OUTDATED or (
        d.plan is not None and r in planned(d.plan) and g.phase == GroupPhase.READY
        and outdated_pods(d.pods.get(r, []), g.attempt, d.state.spec_hash))


def outdated_pods(pods: list[dict], attempt: int, spec_hash: str) -> bool:
    """Pods of the group's current attempt carry another spec's hash."""
    live = [p for p in pods if p["metadata"]["labels"].get(names.LABEL_ATTEMPT) == str(attempt)]
    return any(p["metadata"]["labels"].get(names.LABEL_SPEC_HASH) not in (None, spec_hash) for p in live)


def waits(d: Any, r: int) -> bool:
    """A surge replica waits (is neither planned nor judged) when the cluster had no room for it in
    this roll, or while a desired replica is being replaced in place (it would take that one's GPUs)."""
    if r < d.desired:
        return False
    g = d.groups.get(r)
    if _found_no_room(g):
        return True
    return (g is None or g.phase == GroupPhase.PENDING) and not all(
        d.groups[o].phase in SERVING for o in range(d.desired) if o in d.groups)


def may_take_down(d: Any, r: int) -> str | None:
    """Whether old replica r may go now: "" within maxUnavailable, why when a full cluster forces
    it, None when it waits."""
    serving = sum(1 for o in range(d.extent) if o in d.groups and d.groups[o].phase in SERVING)
    if serving - 1 >= d.desired - d.spec.rollout.max_unavailable:
        return ""
    if d.taken or not _stuck(d) or not _all_others_serve(d, r):
        return None
    return next((g.last_failure for g in map(d.groups.get, range(d.desired, d.extent)) if g), FULL)


def take_down(d: Any, r: int, what: str, why: str = "") -> None:
    """Replica r leaves for its successor: its pods deleted, planned again with the new spec."""
    g = d.groups[r]
    if what == "spec":
        d.act(DeleteGroup(r))
        d.pods[r] = []
        d.plan = drop_replicas(d.plan, {r})
    g.phase, g.last_failure = GroupPhase.PENDING, None
    d.taken += 1
    how = f" in place: {why}; the other replicas keep serving" if why else ""
    d.event("Normal", "Rolling", f"replacing replica {r} with the new {what}{how}")


def after_plan(d: Any) -> None:
    """A surge replica the planner found no room for this pass (not one waiting for the model's
    shape, nor an invalid spec): the roll goes on in place."""
    short = sorted(r for r in set(d.unplaced) if r >= d.desired)
    if not short or d.taken:
        return
    for r in short:   # the mark that keeps it from being tried again in this roll
        d.groups[r].last_failure = f"{FULL} ({d.groups[r].last_failure or 'the planner found none'})"
    old = next((r for r in range(d.desired) if is_old(d, r)), None)
    if old is not None and _all_others_serve(d, old):
        why = d.groups[short[0]].last_failure
        take_down(d, old, "layout" if d.groups[old].phase == GroupPhase.OUTDATED else "spec", why)
        d.save()


def _stuck(d: Any) -> bool:
    """Nothing in the roll can move: every surge replica found no room, and none is on its way."""
    surge = [d.groups.get(r) for r in range(d.desired, d.extent)]
    return all(_found_no_room(g) for g in surge)


def _found_no_room(g: ReplicaGroupStatus | None) -> bool:
    return g is not None and g.phase == GroupPhase.PENDING and (g.last_failure or "").startswith(FULL)


def _all_others_serve(d: Any, r: int) -> bool:
    others: list[ReplicaGroupStatus | None] = [d.groups.get(o) for o in range(d.desired) if o != r]
    return all(g is not None and g.phase in SERVING for g in others)
