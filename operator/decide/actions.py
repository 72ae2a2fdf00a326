"""What one reconcile pass decides (decisions.decide builds it, pure): the actions the reconciler
runs in order through the applier, the Events to post, and the Decision that holds them with the
group records and the plan to store.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence, Union

from shardwise.crds.models import ModelFactsStatus, ReplicaGroupStatus
from shardwise.crds.status import NodeCacheStatus
from shardwise.crds.plan import ShardPlan

NOT_READY_REQUEUE = 5.0     # seconds between passes while something is on its way
STEADY_REQUEUE = 30.0       # safety net when all is Ready (events wake us earlier)


# --- actions, run in order by reconciler.act -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeleteGroup:
    """Every pod of one replica, in one request; `force`: pods on a lost node (grace 0)."""
    replica: int
    force: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DeletePods:
    names: tuple[str, ...]
    force: bool = False


@dataclasses.dataclass(frozen=True)
class ApplyShared:
    """The per-model objects; the plan ConfigMap among them is where the plan is stored."""
    plan: ShardPlan


@dataclasses.dataclass(frozen=True)
class SaveGroups:
    """The group records (and the plan summary) into status, before pods that depend on them exist."""
    plan: ShardPlan | None
    groups: tuple[ReplicaGroupStatus, ...]


@dataclasses.dataclass(frozen=True)
class CreatePods:
    """One replica's pods of one attempt (`stages`: only these; None: all)."""
    replica: int
    attempt: int
    plan: ShardPlan
    stages: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CreatePrePull:
    """The pre-pull pods of one replica group's attempt on these nodes of its plan (spec.model.prePull);
    `group`: the group's own pods, created instead when admission refuses a pre-pull pod."""
    replica: int
    attempt: int
    plan: ShardPlan
    nodes: tuple[str, ...]
    group: CreatePods


@dataclasses.dataclass(frozen=True)
class CreateProbe:
    """The short-lived pod that reads the model's shape where the model lives."""


Action = Union[DeleteGroup, DeletePods, ApplyShared, SaveGroups, CreatePods, CreatePrePull, CreateProbe]


@dataclasses.dataclass(frozen=True)
class Event:
    type: str      # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class World:
    """The cluster as the watches see it: nodes by name, and every live pod holding GPUs."""
    nodes: Mapping[str, Mapping[str, Any]]
    gpu_pods: Sequence[Mapping[str, Any]] = ()


@dataclasses.dataclass
class Decision:
    actions: list[Action]
    groups: dict[int, ReplicaGroupStatus]
    plan: ShardPlan | None                 # the plan in effect after this pass
    events: list[Event]
    requeue_after: float = STEADY_REQUEUE
    invalid: str = ""                      # why the spec cannot run (terminal until it changes)
    finished: bool = False                 # a training job that did every step
    facts: ModelFactsStatus | None = None  # the model's shape as read, for status
    recovered: list[float] = dataclasses.field(default_factory=list)   # failure -> Ready again, seconds
    recoveries: list[str] = dataclasses.field(default_factory=list)    # causes of the groups torn down now
    plan_seconds: float | None = None
    size: int | None = None                # the replicas the model runs with (a training job: maybe fewer)
    node_cache: NodeCacheStatus | None = None   # nodes whose cache holds the model's files, for status
    # groups whose pods wait for their nodes' pre-pull (their GPUs are reserved meanwhile), and what
    # status says of them
    prepulling: tuple[CreatePods, ...] = ()
    prepull_note: str = ""

    def new_pods(self) -> list[CreatePods]:
        return [a for a in self.actions if isinstance(a, CreatePods)]
