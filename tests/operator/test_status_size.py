"""The size of a ShardedModel's status at thousands of replicas: the API server refuses an object over
1.5 MiB and a condition message over 32 KiB, and a refused status write leaves the model's status
stale for good. The status is built by the pure builder (operator/decide/status.py) from the records
a restarted operator reads back, and measured as the compact JSON the API server stores."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from shardwise.crds import names
from shardwise.crds.models import GroupPhase, ReplicaGroupStatus
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.crds.status import FAILURE_MAX_CHARS, GROUPS_MAX_BYTES, STATUS_MAX_PLACEMENTS, group_records
from shardwise.operator.decide import status
from shardwise.operator.decide.actions import Decision
from shardwise.operator.decide.recovery import iso
from shardwise.operator.decide.state import parse_state

MiB = 1 << 20
OBJECT_LIMIT = 1.5 * MiB             # the API server's (etcd's) bound on one object
CONDITION_MESSAGE_LIMIT = 32768      # the CRD's bound on a condition's message
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
REPLICAS, PIPELINE, LAYERS = 5000, 4, 32
# what a pod's termination message may hold: the kubelet keeps 4 KiB of it
LONG_FAILURE = "rank 3 exited 1: " + "Traceback (most recent call last): File worker.py line 12 " * 70


def _plan(replicas: int, pipeline: int) -> ShardPlan:
    per = LAYERS // pipeline
    return ShardPlan.model_construct(
        tensor=2, pipeline=pipeline, replicas=replicas, num_layers=LAYERS, cost=0, shrunk=False, notes=[],
        placements=[StagePlacement.model_construct(
            replica=r, stage=s, node=f"gpu-node-{(r * pipeline + s) // 4:05d}", gpus=2, layer_start=s * per,
            layer_end=(s + 1) * per, embedding=s == 0, head=s == pipeline - 1, params=0, domains={})
            for r in range(replicas) for s in range(pipeline)])


def _body(groups: list[dict]) -> dict:
    spec = {"model": {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": LAYERS, "heads": 32,
                      "kvHeads": 8, "hiddenSize": 4096, "vocabSize": 128256},
            "parallelism": {"tensor": 2, "pipeline": PIPELINE, "replicas": REPLICAS}}
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": "llama-8b-chat", "namespace": "team-a", "uid": "u-1", "generation": 3},
            "spec": spec, "status": {"groups": groups}}


def _unschedulable_pod(r: int, s: int) -> dict:
    return {"metadata": {"name": f"llama-8b-chat-{r}-a2-s{s}", "ownerReferences": [{"uid": "u-1"}],
                         "labels": {names.LABEL_REPLICA: str(r), names.LABEL_STAGE: str(s), names.LABEL_ATTEMPT: "2"}},
            "status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/1250 nodes are available: 1250 Insufficient nvidia.com/gpu. preemption: 0/1250 "
                           "nodes are available: 1250 No preemption victims found for incoming pod."}]}}


def _status(groups: list[ReplicaGroupStatus], pods: list[dict] = ()) -> dict:
    # the records as SaveGroups stores them, read back as a restarted operator reads them
    state = parse_state(_body([g.to_api() for g in groups]), list(pods), None, "img:1")
    assert len(state.groups) == REPLICAS
    decision = Decision(actions=[], groups=dict(state.groups), plan=_plan(REPLICAS, PIPELINE), events=[])
    return status.build_status(state, decision, {}, NOW)


def _size(obj: dict) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


def test_5000_serving_replicas_stay_well_under_the_object_limit():
    """Every replica Ready: about 0.5 MiB (it was 1.9 MiB - status.plan listed all 20,000 stage pods -
    and the API server refused every status write)."""
    ready = [ReplicaGroupStatus(replica=r, attempt=1, phase=GroupPhase.READY, ready_since=iso(NOW)) for r in range(REPLICAS)]
    new = _status(ready)
    size = _size(new)
    print(f"status of {REPLICAS} Ready replicas x {PIPELINE} stages: {size} bytes")
    assert size < 0.6 * MiB
    assert new["phase"] == "Ready" and new["replicas"] == REPLICAS and new["pipeline"] == PIPELINE
    placements = new["plan"]["placements"]
    assert len(placements) == STATUS_MAX_PLACEMENTS and placements[-1] == {
        "replica": STATUS_MAX_PLACEMENTS // PIPELINE - 1, "stage": PIPELINE - 1,
        "node": f"gpu-node-{(STATUS_MAX_PLACEMENTS - 1) // 4:05d}", "gpus": 2, "layers": "24-31"}
    assert [g["replica"] for g in new["groups"]] == list(range(REPLICAS))   # every record kept


def test_5000_replicas_failing_at_once_stay_under_the_object_limit_and_each_message_is_a_line():
    """Every replica Recovering with a 4 KiB termination message and every pod unschedulable: the
    status still fits (it was 84 MiB), each condition message names a few and counts the rest (the
    Recovering message alone was over 20 MiB, past the API's 32 KiB), and every record keeps what
    recovery reads - attempt, restarts, retry time - while failure texts, cut, fill what room the
    records have: the first replicas' are kept, the last ones' left out."""
    retry = iso(NOW + timedelta(seconds=30))
    failing = [ReplicaGroupStatus(replica=r, attempt=2, phase=GroupPhase.RECOVERING, restarts=2,
                                  last_failure=f"replica {r} {LONG_FAILURE}", failed_at=iso(NOW), retry_at=retry)
               for r in range(REPLICAS)]
    pods = [_unschedulable_pod(r, s) for r in range(REPLICAS) for s in range(PIPELINE)]
    new = _status(failing, pods)
    size = _size(new)
    print(f"status of {REPLICAS} failing replicas x {PIPELINE} stages: {size} bytes")
    assert size < 1.1 * MiB
    assert new["phase"] == "Recovering"
    for c in new["conditions"]:
        assert len(c["message"]) < 4096 and "\n" not in c["message"], c["type"]
    recovering = next(c for c in new["conditions"] if c["type"] == "Recovering")["message"]
    assert recovering.startswith("replica 0: replica 0 rank 3 exited 1") and recovering.endswith("; and 4992 more")
    scheduled = next(c for c in new["conditions"] if c["type"] == "PodsScheduled")["message"]
    assert scheduled.startswith("pod llama-8b-chat-0-a2-s0: 0/1250 nodes") and scheduled.endswith(f"; and {REPLICAS * PIPELINE - 8} more")
    records = new["groups"]
    assert _size(records) <= GROUPS_MAX_BYTES
    assert [(g["replica"], g["attempt"], g["phase"], g["restarts"], g["retryAt"]) for g in records] == [
        (r, 2, "Recovering", 2, retry) for r in range(REPLICAS)]
    first, last = records[0], records[-1]
    assert first["lastFailure"].startswith("replica 0 rank 3 exited 1") and len(first["lastFailure"]) == FAILURE_MAX_CHARS
    assert "lastFailure" not in last
    kept = sum("lastFailure" in g for g in records)
    assert all("lastFailure" in g for g in records[:kept]) and kept > 2000
    print(f"failure texts kept for the first {kept} of {REPLICAS} records")


def test_records_that_fit_are_kept_whole():
    """Below the bound nothing is left out: 1,000 groups failing keep every failure text."""
    failing = [ReplicaGroupStatus(replica=r, phase=GroupPhase.RECOVERING, last_failure=LONG_FAILURE) for r in range(1000)]
    assert [g["lastFailure"] for g in group_records(reversed(failing))] == [g.last_failure for g in failing]


def test_a_cut_failure_is_stable_from_pass_to_pass():
    """The record holds the cut text from the moment it is set, so a pass that sets the same
    failure again finds it unchanged (an Event is posted only when a failure changes)."""
    g = ReplicaGroupStatus(replica=0)
    g.last_failure = LONG_FAILURE
    stored = ReplicaGroupStatus.model_validate(g.to_api())
    again = stored.model_copy()
    again.last_failure = LONG_FAILURE
    assert again.last_failure == stored.last_failure == g.last_failure and len(g.last_failure) == FAILURE_MAX_CHARS
