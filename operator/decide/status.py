"""Status: the ShardedModel's status from its groups (pure, no I/O).

Phase of the whole model, from its replica groups:
  Pending     no group has capacity (or nothing planned yet)
  Starting    groups created, not all Ready yet, nothing failed
  Ready       every desired replica Ready
  Running     training: every replica of the job has all its ranks up (reported by the reconciler)
  Recovering  a group lost a pod/node and is being recreated (other replicas keep serving)
  Degraded    some replicas serve, others cannot (no capacity or restart budget spent)
  Failed      nothing can serve: the spec cannot be planned, or every group spent its restarts
  Succeeded   training finished on every replica

Conditions (type: status, reason): Planned, Ready, PodsScheduled, Recovering, Shrunk (report.py); each with a one-line
message. The
conditions' lastTransitionTime changes only when their status changes, as Kubernetes conventions want.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from shardwise.crds.models import GroupPhase, ReplicaGroupStatus

PENDING, STARTING, READY, RUNNING, RECOVERING, DEGRADED, FAILED, SUCCEEDED = (
    "Pending", "Starting", "Ready", "Running", "Recovering", "Degraded", "Failed", "Succeeded")


def model_phase(groups: Iterable[ReplicaGroupStatus], desired: int, invalid: str = "") -> str:
    """`invalid`: why the spec cannot run at all (not a capacity problem) - terminal until it changes."""
    if invalid:
        return FAILED
    # An Outdated group still serves (on the old layout) until its replacement is Ready.
    phases = [GroupPhase.READY if g.phase == GroupPhase.OUTDATED else g.phase
              for g in groups if g.replica < desired]
    phases += [GroupPhase.PENDING] * (desired - len(phases))
    if desired == 0:
        return READY
    if all(p == GroupPhase.SUCCEEDED for p in phases):
        return SUCCEEDED
    ready = phases.count(GroupPhase.READY)
    if ready == desired:
        return READY
    if GroupPhase.RECOVERING in phases:
        return RECOVERING
    stuck = sum(p in (GroupPhase.FAILED, GroupPhase.PENDING) for p in phases)
    if ready and stuck:
        return DEGRADED
    if stuck == desired:
        return FAILED if all(p == GroupPhase.FAILED for p in phases) else PENDING
    return STARTING


def set_condition(conditions: list[dict] | None, type_: str, status: bool, reason: str, message: str,
                  now: str) -> list[dict]:
    """Insert or update one condition; keep lastTransitionTime unless the status flips."""
    out = [dict(c) for c in (conditions or [])]
    value = "True" if status else "False"
    for c in out:
        if c.get("type") == type_:
            if c.get("status") != value:
                c["lastTransitionTime"] = now
            c.update(status=value, reason=reason, message=message)
            return out
    out.append({"type": type_, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": now})
    return out


def condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type_:
            return c
    return None


def phase_message(groups: list[ReplicaGroupStatus], desired: int, invalid: str = "", job: bool = False) -> str:
    """`job`: the groups are one training job's replicas, which share their failure: told once."""
    ready = sum(g.phase == GroupPhase.READY for g in groups if g.replica < desired)
    base = f"{ready}/{desired} replicas ready"
    failures = list(dict.fromkeys(
        f"{'training job' if job else 'replica ' + str(g.replica)}: {g.last_failure}" for g in groups
        if g.phase in (GroupPhase.RECOVERING, GroupPhase.FAILED, GroupPhase.PENDING) and g.last_failure))
    if invalid:
        failures.insert(0, invalid)
    return base + ("; " + "; ".join(failures) if failures else "")
