"""Recovery state machine and status phase (pure; no cluster)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from shardwise.crds.models import ReplicaGroupStatus
from shardwise.operator.decide import recovery
from shardwise.operator.decide import status
from tests.operator.builders import k8s_node

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
POLICY = recovery.Policy(max_restarts=2, backoff_seconds=4, unschedulable_grace_seconds=10)


def _pod(stage, attempt=1, node="n1", phase="Running", ready=True, **extra):
    pod = {"metadata": {"name": f"m-r0-s{stage}-a{attempt}",
                        "labels": {"shardwise.dev/stage": str(stage), "shardwise.dev/attempt": str(attempt)}},
           "spec": {"nodeName": node},
           "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    pod["metadata"].update(extra.pop("metadata", {}))
    pod["status"].update(extra.pop("status", {}))
    return pod


NODES = {"n1": k8s_node("n1"), "n2": k8s_node("n2")}


def G(**record) -> ReplicaGroupStatus:
    """A group record as status stores it (camelCase keys)."""
    return ReplicaGroupStatus.model_validate(record)


def test_all_ready_group_is_ready_and_older_attempts_are_ignored():
    pods = [_pod(0), _pod(1, node="n2"), _pod(1, attempt=0, phase="Failed")]
    v = recovery.assess(pods, 1, 2, NODES, NOW, POLICY)
    assert v.state == "ready" and v.ready == 2
    step = recovery.decide(G(replica=0, attempt=1, phase="Starting"), v, NOW, POLICY)
    assert step.group.phase == "Ready" and step.event == "GroupReady"


def test_node_not_ready_fails_the_whole_group_and_counts_a_restart():
    nodes = {"n1": k8s_node("n1"), "n2": k8s_node("n2", ready=False)}
    v = recovery.assess([_pod(0), _pod(1, node="n2")], 1, 2, nodes, NOW, POLICY)
    assert v.state == "failed" and "node n2" in v.failure and "NotReady" in v.failure
    step = recovery.decide(G(replica=0, attempt=1, phase="Ready", restarts=0), v, NOW, POLICY)
    assert step.action == "teardown" and step.group.phase == "Recovering" and step.group.restarts == 1


def test_deleted_node_and_missing_pod_after_start_are_failures_but_missing_while_creating_is_not():
    v = recovery.assess([_pod(0, node="gone"), _pod(1)], 1, 2, NODES, NOW, POLICY)
    assert v.state == "failed" and "gone" in v.failure
    missing = recovery.assess([_pod(0)], 1, 2, NODES, NOW, POLICY)
    assert missing.state == "missing" and missing.missing == (1,)
    creating = recovery.decide(G(replica=0, attempt=1, phase="Creating"), missing, NOW, POLICY)
    assert creating.action == "create"
    started = recovery.decide(G(replica=0, attempt=1, phase="Starting"), missing, NOW, POLICY)
    assert started.action == "teardown"


def test_evicted_pod_reason_is_reported():
    pod = _pod(0, phase="Failed", status={"reason": "Evicted", "message": "node out of memory"})
    v = recovery.assess([pod, _pod(1)], 1, 2, NODES, NOW, POLICY)
    assert v.failure == "pod m-r0-s0-a1 Evicted: node out of memory"


def test_backoff_doubles_and_budget_ends_in_failed():
    assert [POLICY.backoff(n) for n in (1, 2, 3)] == [4, 8, 16]
    group = G(replica=0, attempt=1, phase="Ready", restarts=0)
    failed = recovery.Verdict("failed", "pod x Failed")
    step = recovery.decide(group, failed, NOW, POLICY)
    assert step.group.retry_at == recovery.iso(NOW + timedelta(seconds=4))
    waiting = recovery.decide(step.group, recovery.Verdict("missing", missing=(0, 1)), NOW + timedelta(seconds=1), POLICY)
    assert waiting.action == "none" and 2.9 < waiting.requeue_after < 3.1
    due = recovery.decide(step.group, recovery.Verdict("missing", missing=(0, 1)), NOW + timedelta(seconds=5), POLICY)
    assert due.action == "replan"
    g = step.group.model_copy(update={"phase": "Ready", "restarts": 2})
    final = recovery.decide(g, failed, NOW, POLICY)
    assert final.action == "fail" and final.group.phase == "Failed"
    assert "after 2 restarts" in final.reason


def test_unschedulable_past_grace_is_replanned_with_the_schedulers_reason():
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            "lastTransitionTime": recovery.iso(NOW - timedelta(seconds=11))}
    pending = _pod(0, phase="Pending", ready=False, status={"conditions": [cond]})
    pending["spec"] = {}
    v = recovery.assess([pending, _pod(1)], 1, 2, NODES, NOW, POLICY)
    assert v.state == "unschedulable" and "Insufficient nvidia.com/gpu" in v.failure
    early = recovery.assess([pending, _pod(1)], 1, 2, NODES, NOW - timedelta(seconds=5), POLICY)
    assert early.state == "starting"


def test_model_phase():
    ready = G(replica=0, phase="Ready")
    assert status.model_phase([ready, G(replica=1, phase="Ready")], 2) == "Ready"
    assert status.model_phase([ready, G(replica=1, phase="Recovering")], 2) == "Recovering"
    assert status.model_phase([ready, G(replica=1, phase="Pending")], 2) == "Degraded"
    assert status.model_phase([G(replica=0, phase="Pending")], 1) == "Pending"
    assert status.model_phase([G(replica=0, phase="Failed")], 1) == "Failed"
    assert status.model_phase([G(replica=0, phase="Starting")], 1) == "Starting"
    assert status.model_phase([ready], 1, invalid="tensor 3 does not divide 32 heads") == "Failed"


def test_condition_transition_time_moves_only_when_status_flips():
    c = status.set_condition([], "Ready", False, "Starting", "0/1", "t1")
    c = status.set_condition(c, "Ready", False, "Starting", "still 0/1", "t2")
    assert c[0]["lastTransitionTime"] == "t1" and c[0]["message"] == "still 0/1"
    c = status.set_condition(c, "Ready", True, "Ready", "1/1", "t3")
    assert c[0]["lastTransitionTime"] == "t3" and c[0]["status"] == "True"


def test_training_pods_that_exited_zero_are_done_not_failed():
    finishing = [_pod(0, phase="Succeeded", ready=False), _pod(1, node="n2")]
    assert recovery.assess(finishing, 1, 2, NODES, NOW, POLICY).state == "failed"   # a server that exits fails
    v = recovery.assess(finishing, 1, 2, NODES, NOW, POLICY, completes=True)
    assert v.state == "ready" and v.ready == 2
    done = [_pod(0, phase="Succeeded", ready=False), _pod(1, node="n2", phase="Succeeded", ready=False)]
    # a finished pod on a node lost afterwards is still finished
    lost = {"n1": k8s_node("n1"), "n2": k8s_node("n2", ready=False)}
    assert recovery.assess(done, 1, 2, lost, NOW, POLICY, completes=True).state == "succeeded"
    step = recovery.decide(G(replica=0, attempt=1, phase="Ready"),
                           recovery.assess(done, 1, 2, lost, NOW, POLICY, completes=True), NOW, POLICY)
    assert step.group.phase == "Succeeded" and step.action == "none"


def test_gang_verdict_one_failure_fails_the_job_and_it_is_done_when_all_are():
    V = recovery.Verdict
    failed = V("failed", "pod m-r1-s0-a1 Failed")
    assert recovery.gang_verdict([V("ready", ready=2), failed]) is failed
    assert recovery.gang_verdict([V("ready", ready=2), V("succeeded", ready=2)]).state == "ready"
    assert recovery.gang_verdict([V("succeeded", ready=2)] * 2).state == "succeeded"
    assert recovery.gang_verdict([V("ready", ready=2), V("missing", "pod of stage 1 is missing", (1,))]).state == "missing"
    assert recovery.gang_verdict([V("ready", ready=2), V("starting", ready=1)]).state == "starting"


def test_failure_message_quotes_the_last_log_line_of_a_failed_pod():
    pod = _pod(0, phase="Failed", ready=False, status={"containerStatuses": [{"state": {"terminated": {
        "exitCode": 2, "reason": "Error",
        "message": "loading...\nshardwise worker: error: model /m/x not found\n"}}}]})
    why = recovery.assess([pod, _pod(1)], 1, 2, NODES, NOW, POLICY).failure
    assert why.endswith("container exited with code 2 (Error): shardwise worker: error: model /m/x not found")


def test_a_pod_pinned_to_a_node_that_went_not_ready_before_binding_fails_at_once():
    pending = _pod(1, node=None, phase="Pending", ready=False,
                   metadata={"annotations": {"shardwise.dev/planned-node": "n2"}})
    pending["spec"] = {}
    nodes = {"n1": k8s_node("n1"), "n2": k8s_node("n2", ready=False)}
    v = recovery.assess([_pod(0), pending], 1, 2, nodes, NOW, POLICY)
    assert v.state == "failed" and v.failure == "node n2 planned for pod m-r0-s1-a1 is NotReady"
    assert recovery.assess([_pod(0), pending], 1, 2, NODES, NOW, POLICY).state == "starting"


def test_a_training_job_tells_its_shared_failure_once():
    groups = [G(replica=r, phase="Recovering", lastFailure="pod m-r0-s0-a1 Failed") for r in range(3)]
    assert status.phase_message(groups, 3, job=True) == "0/3 replicas ready; training job: pod m-r0-s0-a1 Failed"
    assert status.phase_message(groups, 3).count("pod m-r0-s0-a1 Failed") == 3
