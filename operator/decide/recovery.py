"""Recovery: what one replica group's pods say about it, and what to do next (pure, no I/O).

A replica is a torch.distributed group: it cannot lose a rank. So any of these marks the whole group
failed - a pod Failed, deleted, evicted or being deleted; a pod whose node is NotReady or gone; a pod
the scheduler cannot place for longer than a grace period - and the group is torn down, re-planned on
healthy capacity and recreated. Restarts are paced with exponential backoff and capped by
`recovery.maxRestarts`, after which the replica is Failed with the reason.

The per-replica record (crds.models.ReplicaGroupStatus) lives in the ShardedModel's status
(`status.groups`), so a restarted operator reads where each group was and continues; it never holds
state of its own.
"""
from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Iterable, Mapping

from shardwise.crds import names
from shardwise.crds.models import GroupPhase, Recovery, ReplicaGroupStatus

CREATING, STARTING, READY, RECOVERING, PENDING, FAILED, SUCCEEDED, OUTDATED = (
    GroupPhase.CREATING, GroupPhase.STARTING, GroupPhase.READY, GroupPhase.RECOVERING, GroupPhase.PENDING,
    GroupPhase.FAILED, GroupPhase.SUCCEEDED, GroupPhase.OUTDATED)

# Not in the API: the cap of the backoff, and how long a pod may stay unschedulable before its group
# is re-planned elsewhere (the scheduler's own retries settle within seconds).
MAX_BACKOFF_SECONDS = 300.0
UNSCHEDULABLE_GRACE_SECONDS = 15.0


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a group is restarted: spec.recovery (its defaults are the API model's) plus the fixed rules."""

    max_restarts: int = Recovery.model_fields["max_restarts"].default
    backoff_seconds: float = Recovery.model_fields["backoff_seconds"].default
    max_backoff_seconds: float = MAX_BACKOFF_SECONDS
    unschedulable_grace_seconds: float = UNSCHEDULABLE_GRACE_SECONDS

    @classmethod
    def from_spec(cls, recovery: Recovery) -> "Policy":
        return cls(max_restarts=recovery.max_restarts, backoff_seconds=float(recovery.backoff_seconds))

    def backoff(self, restarts: int) -> float:
        """Delay before the `restarts`-th recreation of a group: base, 2×base, 4×base... capped."""
        return min(self.max_backoff_seconds, self.backoff_seconds * 2 ** max(0, restarts - 1))


class GroupHealth(str, Enum):
    """What the pods of a group's current attempt say about it (Verdict.state)."""

    MISSING = "missing"              # a stage's pod does not exist
    FAILED = "failed"                # a pod failed, was deleted, or its node is lost
    UNSCHEDULABLE = "unschedulable"  # a pod could not be placed for longer than the grace period
    STARTING = "starting"            # every pod exists, not all Ready yet
    READY = "ready"                  # every pod Ready
    SUCCEEDED = "succeeded"          # training: every pod exited 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the pods of a group's current attempt say. `failure` is one line naming the pod and why."""
    state: GroupHealth
    failure: str = ""
    missing: tuple[int, ...] = ()  # stages whose pod does not exist
    ready: int = 0                 # pods Ready
    cause: str = ""                # what kind of failure, one of CAUSES (a metric label)


# The kinds of failure a group can meet (the values of shardwise_recoveries_total's cause label).
CAUSES = ("node-not-ready", "node-gone", "evicted", "pod-deleted", "unschedulable", "pod-failed")


def node_ready(node: Mapping[str, Any] | None) -> bool:
    if not node or node.get("metadata", {}).get("deletionTimestamp"):
        return False
    for c in node.get("status", {}).get("conditions", []) or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {}) or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])


def _unschedulable(pod: Mapping[str, Any]) -> tuple[str, datetime | None] | None:
    for c in pod.get("status", {}).get("conditions", []) or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "Unschedulable", parse_iso(c.get("lastTransitionTime"))
    return None


def unschedulable_message(pod: Mapping[str, Any]) -> str:
    """The scheduler's reason when it could not place this pod, else ""."""
    u = _unschedulable(pod)
    return u[0] if u else ""


def on_lost_node(pod: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]]) -> bool:
    """The pod is bound to a node that is NotReady or gone: its kubelet will not answer, so the pod
    is force-deleted rather than waited for."""
    node = (pod.get("spec") or {}).get("nodeName")
    return bool(node) and not node_ready(nodes.get(node))


def _pod_failure(pod: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
                 completes: bool) -> tuple[str, str]:
    """(cause, one line) of what ends this pod's group, or ("", ""). `completes`: the pod runs to an
    end (training), so exiting 0 is its success, not a failure."""
    name = pod["metadata"]["name"]
    status = pod.get("status", {}) or {}
    if status.get("phase") == "Failed":
        reason = status.get("reason") or "Failed"
        message = status.get("message") or _terminated_message(status)
        return ("evicted" if reason == "Evicted" else "pod-failed",
                f"pod {name} {reason}" + (f": {message}" if message else ""))
    if status.get("phase") == "Succeeded":
        return ("", "") if completes else ("pod-failed", f"pod {name} exited")
    node = pod.get("spec", {}).get("nodeName")
    if not node:
        # Not bound yet, and the node it is pinned to went away meanwhile (a group re-planned in the
        # seconds before a lost node is marked NotReady): it would only wait out the unschedulable
        # grace, so re-plan at once.
        node = (pod["metadata"].get("annotations") or {}).get(names.ANNOTATION_PLANNED_NODE)
        of = f"planned for pod {name}"
    else:
        of = f"of pod {name}"
    if node and node not in nodes:
        return "node-gone", f"node {node} {of} is gone"
    if node and not node_ready(nodes[node]):
        return "node-not-ready", f"node {node} {of} is NotReady"
    if pod["metadata"].get("deletionTimestamp"):
        return "pod-deleted", f"pod {name} is being deleted"
    return "", ""


def _terminated_message(status: Mapping[str, Any]) -> str:
    for cs in status.get("containerStatuses", []) or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            why = f"container exited with code {term.get('exitCode')} ({term.get('reason', '')})".strip()
            # the kubelet puts the log's tail there (terminationMessagePolicy FallbackToLogsOnError):
            # its last line is usually the worker's own one-line error
            last = next((line.strip() for line in reversed((term.get("message") or "").splitlines())
                         if line.strip()), "")
            return f"{why}: {last[:300]}" if last else why
    return ""


def termination_message(pod: Mapping[str, Any]) -> str:
    """What the pod's (first) container left as its termination message, or ""."""
    for cs in (pod.get("status") or {}).get("containerStatuses", []) or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("message"):
            return term["message"]
    return ""


def assess(pods: Iterable[Mapping[str, Any]], attempt: int, stages: int,
           nodes: Mapping[str, Mapping[str, Any]], now: datetime, policy: Policy,
           completes: bool = False) -> Verdict:
    """Judge one replica's group from its pods of the current attempt (older attempts are ignored).
    `completes` (training): pods that exited 0 are done, and count as ready while the others finish."""
    by_stage: dict[int, Mapping[str, Any]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels", {})
        if labels.get(names.LABEL_ATTEMPT) != str(attempt):
            continue
        by_stage[int(labels[names.LABEL_STAGE])] = pod
    missing = tuple(s for s in range(stages) if s not in by_stage)
    done = {s for s, p in by_stage.items() if (p.get("status") or {}).get("phase") == "Succeeded"}
    if completes and not missing and len(done) == stages:
        return Verdict(GroupHealth.SUCCEEDED, "", (), stages)  # training finished on every rank
    for s in sorted(by_stage):
        cause, why = _pod_failure(by_stage[s], nodes, completes)
        if why:
            return Verdict(GroupHealth.FAILED, why, missing, cause=cause)
    ready = sum(pod_ready(p) or (completes and s in done) for s, p in by_stage.items())
    if missing:
        return Verdict(GroupHealth.MISSING, f"pod of stage {missing[0]} is missing", missing, ready, cause="pod-deleted")
    for s in sorted(by_stage):
        u = _unschedulable(by_stage[s])
        if u:
            message, since = u
            waited = (now - since).total_seconds() if since else 0.0
            if waited >= policy.unschedulable_grace_seconds:
                return Verdict(GroupHealth.UNSCHEDULABLE, f"pod {by_stage[s]['metadata']['name']} cannot be scheduled: "
                                                f"{message}", (), ready, cause="unschedulable")
    if ready == stages:
        return Verdict(GroupHealth.READY, "", (), ready)
    return Verdict(GroupHealth.STARTING, "", (), ready)


def gang_verdict(verdicts: Iterable[Verdict]) -> Verdict:
    """One verdict for groups that live and die together (the replicas of a training job, one
    torch.distributed world): the first failure fails them all; done when all are done."""
    verdicts = list(verdicts)
    for v in verdicts:
        if v.state in (GroupHealth.FAILED, GroupHealth.UNSCHEDULABLE):
            return v
    ready = sum(v.ready for v in verdicts)
    if all(v.state == GroupHealth.SUCCEEDED for v in verdicts):
        return Verdict(GroupHealth.SUCCEEDED, "", (), ready)
    missing = next((v for v in verdicts if v.state == GroupHealth.MISSING), None)
    if missing is not None:
        return Verdict(GroupHealth.MISSING, missing.failure, missing.missing, ready, cause=missing.cause)
    if all(v.state in (GroupHealth.READY, GroupHealth.SUCCEEDED) for v in verdicts):
        return Verdict(GroupHealth.READY, "", (), ready)
    return Verdict(GroupHealth.STARTING, "", (), ready)


class StepAction(str, Enum):
    """What a group's step asks of the pass (Step.action)."""

    NONE = "none"            # nothing now (maybe a requeue)
    CREATE = "create"        # create the group's missing pods
    TEARDOWN = "teardown"    # delete the group; it is re-planned after the backoff
    REPLAN = "replan"        # plan the group afresh
    FAIL = "fail"            # delete the group; its restart budget is spent


@dataclasses.dataclass
class Step:
    """What the reconciler must do for one group, and the group record to store afterwards."""
    action: StepAction
    group: ReplicaGroupStatus
    reason: str = ""               # one line for the condition and the Event
    event: str = ""                # Event reason when this step is a transition worth reporting
    requeue_after: float | None = None
    cause: str = ""                # a failure's kind (Verdict.cause)


def decide(group: ReplicaGroupStatus, verdict: Verdict, now: datetime, policy: Policy) -> Step:
    """The recovery state machine for one replica group.

    Creating --all pods exist--> Starting --all Ready--> Ready
    any ----failure--> Recovering (teardown; restarts+1) --backoff elapsed--> replan --> Creating
    Recovering with restarts > maxRestarts --> Failed (terminal until the spec changes)
    """
    g = group.model_copy()
    if g.phase in (FAILED, SUCCEEDED):
        return Step(StepAction.NONE, g)
    if verdict.state == GroupHealth.SUCCEEDED:
        g.phase = SUCCEEDED
        return Step(StepAction.NONE, g, event="Succeeded")

    if g.phase == RECOVERING:
        # The group was torn down when the failure was seen; recreate it once the backoff has passed.
        until = parse_iso(g.retry_at)
        if until and now < until:
            return Step(StepAction.NONE, g, requeue_after=(until - now).total_seconds())
        return Step(StepAction.REPLAN, g, g.last_failure or "")

    if g.phase == PENDING:
        return Step(StepAction.REPLAN, g, g.last_failure or "")

    if verdict.state in (GroupHealth.FAILED, GroupHealth.UNSCHEDULABLE) or (
            verdict.state == GroupHealth.MISSING and g.phase in (STARTING, READY)):
        return _failed(g, verdict, now, policy)

    if verdict.state == GroupHealth.MISSING:
        g.phase = CREATING
        return Step(StepAction.CREATE, g)
    if verdict.state == GroupHealth.READY:
        if g.phase != READY:
            g.phase, g.ready_since = READY, iso(now)
            return Step(StepAction.NONE, g, event="GroupReady")
        return Step(StepAction.NONE, g)
    g.phase = STARTING  # starting
    return Step(StepAction.NONE, g)


def _failed(g: ReplicaGroupStatus, verdict: Verdict, now: datetime, policy: Policy) -> Step:
    g.restarts += 1
    g.last_failure = verdict.failure
    g.failed_at = g.failed_at or iso(now)
    if g.restarts > policy.max_restarts:
        g.phase = FAILED
        return Step(StepAction.FAIL, g, f"replica {g.replica} gave up after {policy.max_restarts} restarts; "
                               f"last failure: {verdict.failure}", event="RestartBudgetExhausted")
    g.phase = RECOVERING
    delay = policy.backoff(g.restarts)
    g.retry_at = iso(datetime.fromtimestamp(now.timestamp() + delay, timezone.utc))
    return Step(StepAction.TEARDOWN, g, verdict.failure, event="Recovering", requeue_after=delay, cause=verdict.cause)
