"""The ShardedModel's status, as the operator writes it (operator/decide/status.py builds it): the
model's phase and conditions, the plan in effect, the replica groups' records, training progress.

The whole status lives in one object, which the API server caps at 1.5 MiB (etcd's request limit),
so what grows with the replica count is kept short: a group record's failure text is cut to
FAILURE_MAX_CHARS, the records together take at most GROUPS_MAX_BYTES (group_records), and
status.plan lists the placements of at most STATUS_MAX_PLACEMENTS stage pods (whole replicas, the
first ones); the rest are the pods' own (`kubectl get pods -o wide`).
"""
from __future__ import annotations

import json
from enum import Enum
from typing import Any, Iterable, Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from shardwise.crds.apimodel import ApiModel
from shardwise.crds.autoscaling import AutoscalingStatus


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


class ConditionType(str, Enum):
    """The types of status.conditions (operator/decide/status.py and download.py set them)."""

    PLANNED = "Planned"
    READY = "Ready"
    APPLIED = "Applied"
    SHRUNK = "Shrunk"
    PODS_SCHEDULED = "PodsScheduled"
    RECOVERING = "Recovering"
    DOWNLOADING = "Downloading"    # a remote model's pods are fetching it (status.download)
    PRE_PULLING = "PrePulling"     # pre-pull pods warm the planned nodes' caches (spec.model.prePull)


class DownloadReason(str, Enum):
    """The reason of the Downloading condition."""

    FETCHING = "Fetching"          # bytes are arriving
    STALLED = "Stalled"            # a pod has had no byte for crds/download.py STALL_SECONDS
    DONE = "Done"                  # every pod reporting has its share in its cache


class PrePullReason(str, Enum):
    """The reason of the PrePulling condition."""

    FETCHING = "Fetching"          # pre-pull pods run; the groups' pods wait for them
    DONE = "Done"                  # no group waits for a pre-pull


# status.download lists at most this many replicas (the first ones still fetching)
STATUS_MAX_DOWNLOADS = 256


class ReplicaDownload(ApiModel):
    """status.download: one replica's fetch, the sum of its pods' reports."""

    replica: int = Field(ge=0)
    bytes_fetched: int = Field(0, ge=0)
    bytes_total: int = Field(0, ge=0, description="bytes its pods fetch (what their caches did not hold)")
    percent: int = Field(0, ge=0, le=100)
    rate: int = Field(0, ge=0, description="bytes per second, its pods together")


class Condition(ApiModel):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: Optional[str] = Field(None, max_length=1024)
    message: Optional[str] = Field(None, max_length=32768)
    last_transition_time: Optional[str] = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: Optional[int] = Field(None, ge=0)


# How much of what grows with the replica count status keeps (see the module docstring): the
# status of 5,000 replicas stays near 0.5 MiB when they serve, and near 1 MiB with every one of
# them failing at once (tests/operator/test_status_size.py measures both).
FAILURE_MAX_CHARS = 128
GROUPS_MAX_BYTES = 1 << 20
STATUS_MAX_PLACEMENTS = 256


def shortened(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, marked as cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
    max_sequences: int = Field(0, ge=0, description="serving: sequences each replica runs at once")
    placements: list[PlacementSummary] = Field(default_factory=list)

    @classmethod
    def from_plan(cls, plan: Any) -> "PlanSummary":
        """Summary of a crds.plan.ShardPlan for status.plan: the placements of the first replicas,
        STATUS_MAX_PLACEMENTS stage pods at most (always one whole replica)."""
        listed = sorted({p.replica for p in plan.placements})[:max(1, STATUS_MAX_PLACEMENTS // plan.pipeline)]
        shown = set(listed)
        return cls(tensor=plan.tensor, pipeline=plan.pipeline, replicas=plan.replicas, cost=plan.cost,
                   shrunk=plan.shrunk, max_sequences=plan.max_sequences, placements=[
                       PlacementSummary(replica=p.replica, stage=p.stage, node=p.node, gpus=p.gpus,
                                        layers=f"{p.layer_start}-{p.layer_end - 1}")
                       for p in sorted(plan.placements, key=lambda p: (p.replica, p.stage)) if p.replica in shown])


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
    downloaded: Optional[int] = Field(None, ge=0, description=(
        "a remote model: the attempt whose Downloaded Event was posted (its pods are no longer asked "
        "for their download)"))

    # Assignments are validated too, so the record holds the cut text from the moment it is set:
    # a pass compares it with what status holds (and posts an Event only when it changed).
    model_config = ConfigDict(validate_assignment=True)

    @field_validator("last_failure")
    @classmethod
    def _short_failure(cls, text: Optional[str]) -> Optional[str]:
        """A pod's own words (its termination message: up to 4 KiB) are cut, so thousands of
        records fit in status; the Event posted with the failure carries the whole text."""
        return None if text is None else shortened(text, FAILURE_MAX_CHARS)


def group_records(groups: Iterable[ReplicaGroupStatus]) -> list[dict[str, Any]]:
    """status.groups: the records in replica order, as JSON. Should they pass GROUPS_MAX_BYTES
    (thousands of groups failing at once), the last records' failure texts are left out until they
    fit; what recovery resumes from - attempt, phase, restarts, times - is always kept."""
    records = [g.to_api() for g in sorted(groups, key=lambda g: g.replica)]
    size = sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in records)
    for record in reversed(records):
        if size <= GROUPS_MAX_BYTES:
            break
        if "lastFailure" in record:
            size -= len(json.dumps({"lastFailure": record.pop("lastFailure")}, separators=(",", ":"))) - 1
    return records


class ModelFactsStatus(ApiModel):
    """What the operator read of the model itself, cached so that it is read once per uri: by a probe
    pod that reads it where it lives (a pvc:// claim, a store), or from a path the operator can read.
    A read that could not reach the store is kept apart from an answer that is final: it is tried
    again at retryAt, with a backoff (operator/decide/decisions.py _probe)."""

    uri: str = Field(description="the spec.model.uri these facts are of")
    facts: Optional[dict[str, Any]] = Field(None, description="the model's shape: layers, heads, sizes, parameters")
    error: Optional[str] = Field(None, description="why the model could not be read (final until the spec changes)")
    generation: Optional[int] = Field(None, description="the spec generation a failed read belongs to; "
                                                         "a changed spec reads the model again")
    unreachable: Optional[str] = Field(None, description=(
        "why the last read could not reach the model's store (no connection, a timeout, HTTP 5xx or "
        "429): not the spec's error; the model is read again at retryAt"))
    failures: Optional[int] = Field(None, ge=0, description="reads in a row that could not reach the store")
    retry_at: Optional[str] = Field(None, json_schema_extra={"format": "date-time"},
                                    description="when the model is read again after an unreachable store")


# status.nodeCache lists at most this many nodes (the most recently seen first)
NODE_CACHE_MAX_NODES = 64


class NodeCacheStatus(ApiModel):
    """status.nodeCache: the nodes whose node-local cache the operator saw fill with this model's files
    (a pod of the model Ready there, or a pre-pull pod done). A hint for the planner, which prefers
    these nodes among otherwise equal placements; dropped when spec.model.uri or endpoint changes."""

    uri: str = Field(max_length=4096, description="the spec.model.uri the nodes hold files of")
    endpoint: Optional[str] = Field(None, max_length=2048, description="its spec.model.endpoint (s3://), if any")
    nodes: list[str] = Field(default_factory=list, max_length=NODE_CACHE_MAX_NODES, description=(
        "node names, the most recently seen first"))


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
    download: list[ReplicaDownload] = Field(default_factory=list, max_length=STATUS_MAX_DOWNLOADS, description=(
        "a remote model (hf://, s3://, oci://): each replica still fetching it, as its pods report"))
    node_cache: Optional[NodeCacheStatus] = Field(None, description=(
        "a remote model in the node-local cache: the nodes seen holding its files (a placement hint)"))
    autoscaling: Optional[AutoscalingStatus] = Field(None, description="the autoscaler's last decision (spec.autoscaling)")
