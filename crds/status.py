"""The ShardedModel's status, as the operator writes it (operator/decide/status.py builds it): the
model's phase and conditions, the plan in effect, the replica groups' records, training progress.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Literal, Optional

from pydantic import Field

from shardwise.crds.apimodel import ApiModel


class ModelPhase(str, Enum):
    """The phases of the whole model in status.phase (operator/decide/status.py says when each holds)."""

    PENDING = "Pending"          # no group has capacity (or nothing planned yet)
    STARTING = "Starting"        # groups created, not all Ready yet, nothing failed
    READY = "Ready"              # every inference replica serves
    RUNNING = "Running"          # a training job has all its ranks up
    RECOVERING = "Recovering"    # a group lost a pod or node and is being recreated
    DEGRADED = "Degraded"        # some replicas serve, others cannot
    FAILED = "Failed"            # nothing can serve
    SUCCEEDED = "Succeeded"      # a training job finished every step and committed its last checkpoint


PHASES = tuple(p.value for p in ModelPhase)


class Condition(ApiModel):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: Optional[str] = Field(None, max_length=1024)
    message: Optional[str] = Field(None, max_length=32768)
    last_transition_time: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: Optional[int] = Field(None, ge=0)


class PlacementSummary(ApiModel):
    replica: int = Field(ge=0)
    stage: int = Field(ge=0)
    node: str
    gpus: int = Field(ge=1)
    layers: str = Field(description="first-last decoder layer, e.g. 0-11")


class PlanSummary(ApiModel):
    tensor: int = Field(ge=1)
    pipeline: int = Field(ge=1)
    replicas: int = Field(ge=0)
    cost: int = Field(0, ge=0, description="topology boundaries crossed between consecutive stages")
    shrunk: bool = False
    placements: list[PlacementSummary] = Field(default_factory=list)

    @classmethod
    def from_plan(cls, plan: Any) -> "PlanSummary":
        """Summary of a crds.plan.ShardPlan for status.plan."""
        return cls(tensor=plan.tensor, pipeline=plan.pipeline, replicas=plan.replicas, cost=plan.cost,
                   shrunk=plan.shrunk, placements=[
                       PlacementSummary(replica=p.replica, stage=p.stage, node=p.node, gpus=p.gpus,
                                        layers=f"{p.layer_start}-{p.layer_end - 1}")
                       for p in plan.placements])


class LastCheckpoint(ApiModel):
    step: int = Field(ge=0)
    time: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    path: Optional[str] = None


class TrainingProgress(ApiModel):
    """Where a training job is, as its first rank last reported it."""

    step: int = Field(0, ge=0, description="optimizer steps done")
    steps: int = Field(0, ge=0, description="steps asked for (spec.training.steps)")
    loss: Optional[float] = Field(None, description="loss of the last step")
    time: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})


class GroupPhase(str, Enum):
    """Where one replica group is (operator/decide/recovery.py:decide moves it between these)."""

    CREATING = "Creating"      # pods being created; missing pods are created, not counted as failures
    STARTING = "Starting"      # every pod exists; waiting for all of them to be Ready
    READY = "Ready"
    RECOVERING = "Recovering"  # failure seen; group torn down, waiting for backoff, then re-planned
    PENDING = "Pending"        # not planned (new, short of capacity, or waiting for the model's shape)
    FAILED = "Failed"          # restart budget spent; terminal until the spec changes
    SUCCEEDED = "Succeeded"    # training: every pod exited 0
    OUTDATED = "Outdated"      # serving on an old layout or spec; replaced one replica at a time


class ReplicaGroupStatus(ApiModel):
    """The operator's record of one replica group (its pods restart as one unit), kept in status so
    that a restarted operator continues where it was."""

    replica: int = Field(ge=0)
    attempt: int = Field(0, ge=0, description="incarnation of the group; part of its pods' names")
    phase: GroupPhase = Field(GroupPhase.PENDING, description="one of " + ", ".join(p.value for p in GroupPhase))
    restarts: int = Field(0, ge=0)
    last_failure: Optional[str] = None
    failed_at: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    retry_at: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    ready_since: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})


class ModelFactsStatus(ApiModel):
    """What the operator read of the model itself, cached so that it is read once per uri: by a probe
    pod that mounts the claim of a pvc:// uri (only pods can), or from a path the operator can read."""

    uri: str = Field(description="the spec.model.uri these facts are of")
    facts: Optional[dict[str, Any]] = Field(None, description="the model's shape: layers, heads, sizes, parameters")
    error: Optional[str] = Field(None, description="why the model could not be read")
    generation: Optional[int] = Field(None, description="the spec generation a failed read belongs to; "
                                                         "a changed spec reads the model again")


class ShardedModelStatus(ApiModel):
    phase: Optional[str] = Field(None, description="One of " + ", ".join(PHASES) + ".")
    message: Optional[str] = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    observed_generation: Optional[int] = Field(None, ge=0)
    restarts: int = Field(0, ge=0)
    tensor: Optional[int] = Field(None, ge=1, description="tensor-parallel degree in effect")
    pipeline: Optional[int] = Field(None, ge=1, description="pipeline stages in effect")
    replicas: int = Field(0, ge=0, description="replicas planned (scale subresource)")
    ready_replicas: int = Field(0, ge=0)
    ready_shards: int = Field(0, ge=0, description="stage pods ready, across replicas")
    selector: Optional[str] = Field(None, description="label selector of the pods (scale subresource)")
    endpoint: Optional[str] = Field(None, description="URL of the OpenAI-compatible API")
    plan: Optional[PlanSummary] = None
    last_checkpoint: Optional[LastCheckpoint] = Field(None, description=(
        "training: the newest complete checkpoint of the shared tier (checkpoint.claim), which a "
        "restarted job resumes from when nothing newer is on its nodes"))
    last_local_checkpoint: Optional[LastCheckpoint] = Field(None, description=(
        "training: the newest complete checkpoint of the local tier (checkpoint.local), on the nodes' "
        "own disks; lost with a node"))
    training: Optional[TrainingProgress] = None
    groups: list[ReplicaGroupStatus] = Field(default_factory=list, description="one record per replica group")
    model_facts: Optional[ModelFactsStatus] = Field(None, description="the model's shape as the operator read it")
