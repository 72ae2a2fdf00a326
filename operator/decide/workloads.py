"""What differs between a served model and a training job, in one place.

A served model's replicas are independent torch.distributed worlds: each is judged, restarted and
replaced on its own, a new layout or spec rolls through them as spec.rollout says (surge
replicas beside them, or in place when the cluster has no room), and the model is Ready
when every replica serves.

A training job is one world over all its replicas (data parallel averages gradients across them), so
its replicas are a gang: one verdict for all (the first failure tears every replica down), one
attempt number, planned all or none (at one size: fewer replicas than asked, down to
training.minReplicas, when capacity is short - elastic.py - growing back when it returns); a new
layout, replica count or spec restarts the whole job, which resumes from its latest complete
checkpoint; 0 replicas pauses it; it ends Succeeded.

`decisions.decide()` and decide/status.py ask the workload instead of branching on `spec.workload`
(crds Workload, which render/ and planning/ read directly: they may not import decide/).
"""
from __future__ import annotations

from typing import Iterable

from shardwise.crds.models import GroupPhase, ModelPhase, ReplicaGroupStatus, ShardedModelSpec
from shardwise.crds.models import Workload as WorkloadKind


class Workload:
    gang = False          # replicas live, die and are planned together
    completes = False     # pods run to an end: exiting 0 is success, not failure
    serves = True         # has an endpoint, a serving Service and a disruption budget
    noun = "replica"      # how events and messages name the unit that restarts

    def who(self, replica: int) -> str:
        return f"replica {replica}"

    def attempts(self, groups: Iterable[ReplicaGroupStatus]) -> dict[int, int]:
        """The attempt number of each group being (re)created: each its own next one."""
        return {g.replica: g.attempt + 1 for g in groups}

    def teardown_message(self, desired: int) -> str:
        return "tearing the group down"

    def restarts(self, groups: Iterable[ReplicaGroupStatus]) -> int:
        return sum(g.restarts for g in groups)

    def model_phase(self, phase: ModelPhase, finished: bool, desired: int) -> tuple[ModelPhase, str | None]:
        """The model's phase (and a message overriding the usual one) from the groups' phase."""
        return phase, None


class TrainingJob(Workload):
    gang = True
    completes = True
    serves = False
    noun = "training job"

    def who(self, replica: int) -> str:
        return "training job"

    def attempts(self, groups: Iterable[ReplicaGroupStatus]) -> dict[int, int]:
        # One shared number: the job's rendezvous port and its pods' names depend on it.
        groups = list(groups)
        shared = max((g.attempt for g in groups), default=0) + 1
        return {g.replica: shared for g in groups}

    def teardown_message(self, desired: int) -> str:
        return f"tearing down all {desired} replicas; it resumes from the last complete checkpoint"

    def restarts(self, groups: Iterable[ReplicaGroupStatus]) -> int:
        # The replicas restart together: one restart of the job, not one per replica.
        return max((g.restarts for g in groups), default=0)

    def model_phase(self, phase: ModelPhase, finished: bool, desired: int) -> tuple[ModelPhase, str | None]:
        if finished:
            return ModelPhase.SUCCEEDED, None
        if desired == 0:
            return ModelPhase.PENDING, "paused at 0 replicas; scale up to resume from the last checkpoint"
        if phase == ModelPhase.READY:
            return ModelPhase.RUNNING, None
        return phase, None


SERVING, TRAINING = Workload(), TrainingJob()


def workload_of(spec: ShardedModelSpec) -> Workload:
    return TRAINING if spec.workload == WorkloadKind.TRAINING else SERVING


def finished(groups: Iterable[ReplicaGroupStatus]) -> bool:
    groups = list(groups)
    return bool(groups) and all(g.phase == GroupPhase.SUCCEEDED for g in groups)
