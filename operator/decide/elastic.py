"""Elastic training: the sizes a training job may run at, and when it grows back (pure).

A training job asks for `parallelism.replicas` and accepts as few as `training.minReplicas`. It is
always planned whole at one size: the largest that fits, from the replicas asked down to
minReplicas, only multiples of the ZeRO-3 shard degree the spec fixes (the shard degree stays as
asked, so the plan keeps the spec's layout) and of training.contextParallel (the ranks of a
sequence are replicas: a job runs whole sequences). Below minReplicas it waits, Pending.

The size a job runs at is its stored plan's replica count (between minReplicas and the replicas
asked): nothing else needs storing, and a restarted operator reads it back with the plan. While it
runs short, every pass that finds the job Running for GROW_AFTER_SECONDS or more asks the planner
for a wider plan; when one fits, the job is stopped whole (its ranks save a shared checkpoint on
SIGTERM) and, once every old pod is gone, planned again: at the largest size that fits then.
"""
from __future__ import annotations

import math
from datetime import datetime
from typing import Iterable

from shardwise.crds.models import DataParallel, GroupPhase, ReplicaGroupStatus, ShardedModelSpec
from shardwise.crds.plan import ShardPlan
from shardwise.operator.planning import groups as planning

GROW_AFTER_SECONDS = 30.0   # a job runs this long at a size before it may grow (no restart loops)
SHRUNK_NOTE = "running {got} of {asked} replicas (minReplicas {floor}{step}): {why}"


def step(spec: ShardedModelSpec) -> int:
    """What every size the job runs at is a multiple of: the shard degree the spec fixes (in
    replicas) and the context-parallel degree."""
    return math.lcm(planning.asked_shard(spec) or 1, spec.context_parallel())


def sizes(spec: ShardedModelSpec) -> list[int]:
    """The replica counts the job may run at, largest first (just the one asked when not elastic)."""
    asked, floor, every = spec.parallelism.replicas, spec.min_replicas(), step(spec)
    return [n for n in range(asked, floor - 1, -1) if n % every == 0 and n > 0] or [asked]


def at_size(spec: ShardedModelSpec, replicas: int) -> ShardedModelSpec:
    """The spec as the planner sees it at `replicas`: the same ZeRO-3 shard degree as asked (the
    replicate degree follows), and no shrinking of the planner's own (recovery.allowShrink is for
    served models: a job runs whole at one size)."""
    no_shrink = {"recovery": spec.recovery.model_copy(update={"allow_shrink": False})}
    if replicas == spec.parallelism.replicas or spec.training is None:
        return spec.model_copy(update=no_shrink)
    shard = planning.asked_shard(spec)     # in replicas: dataParallel.shard x contextParallel
    training = spec.training.model_copy(update={
        "data_parallel": DataParallel(shard=shard // spec.context_parallel()) if shard else None, "min_replicas": None})
    return spec.model_copy(update={
        "parallelism": spec.parallelism.model_copy(update={"replicas": replicas}), "training": training,
        **no_shrink})


def running_size(spec: ShardedModelSpec, plan: ShardPlan | None) -> int:
    """The replicas the job runs with: its stored plan's count when that is a size it may run at
    short of the replicas asked, else the replicas asked."""
    asked = spec.parallelism.replicas
    if plan is None or not planning.layout_matches(plan, spec):
        return asked
    got = len({p.replica for p in plan.placements})
    return got if got in sizes(spec) and got < asked else asked


def may_grow(spec: ShardedModelSpec, size: int, groups: Iterable[ReplicaGroupStatus], now: datetime) -> bool:
    """A job running short, every replica up for GROW_AFTER_SECONDS at least: time to try a wider plan."""
    groups = list(groups)
    if size >= spec.parallelism.replicas or len(groups) != size or not groups:
        return False
    if any(g.phase != GroupPhase.READY or not g.ready_since for g in groups):
        return False
    since = max(datetime.fromisoformat(g.ready_since.replace("Z", "+00:00")) for g in groups)
    return (now - since).total_seconds() >= GROW_AFTER_SECONDS


def shrunk_note(spec: ShardedModelSpec, got: int, why: str) -> str:
    return SHRUNK_NOTE.format(got=got, asked=spec.parallelism.replicas, floor=spec.min_replicas(),
                              step=_step_words(spec), why=why)


def _step_words(spec: ShardedModelSpec) -> str:
    """Why only some sizes are run, for the note and the Event: "" when every size may be."""
    every, context, shard = step(spec), spec.context_parallel(), planning.asked_shard(spec)
    if every == 1:
        return ""
    why = [f"training.contextParallel {context}"] if context > 1 else []
    why += [f"the ZeRO-3 shard degree {shard}"] if shard and shard > 1 else []
    return f"; only multiples of {every}: {' and '.join(why)}"


def shrunk_reason(plan: ShardPlan | None) -> str:
    """Why a stored plan runs fewer replicas than asked (its note), or ""."""
    if plan is None or not plan.shrunk:
        return ""
    return next((n for n in plan.notes if n.startswith(("running ", "shrunk to "))), "shrunk")
