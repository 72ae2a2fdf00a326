"""spec.rollout: how decide() replaces a serving model's replicas for a new image or layout, driven
pass by pass through the real parser, planner, renderer and status builder (test_decide's Cluster)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from shardwise.crds import names
from shardwise.crds.models import ShardedModelSpec, describe_validation_error
from shardwise.crds.rollout import NO_STEP
from tests.operator.builders import k8s_node as node
from tests.operator.test_decide import LLAMA_8B, Cluster, rack, serving


def hashes(c: Cluster) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for p in c.replica_pods():
        labels = p["metadata"]["labels"]
        out.setdefault(int(labels[names.LABEL_REPLICA]), set()).add(labels[names.LABEL_SPEC_HASH])
    return out


def roll(c: Cluster, passes: int = 12) -> list[int]:
    """Passes until the roll ends (pods starting as they are made); readyReplicas after each pass."""
    seen = []
    for _ in range(passes):
        c.run_all()
        c.reconcile()
        seen.append(c.status["readyReplicas"])
        if c.status["phase"] == "Ready" and len(hashes(c)) == c.body["spec"]["parallelism"]["replicas"] \
                and len(set().union(*hashes(c).values())) == 1 and len(c.status["groups"]) == len(hashes(c)):
            break
    return seen


def two_replicas(nodes: str, **extra) -> Cluster:
    c = Cluster(serving(tensor=8, pipeline=1, replicas=2, **extra), rack(nodes, "a"))
    c.ready(2)
    return c


def test_max_surge_2_starts_two_new_replicas_beside_the_old_ones_when_there_is_room():
    c = two_replicas("n0 n1 n2 n3", rollout={"maxSurge": 2})
    old = set().union(*hashes(c).values())
    c.edit(image="img:2")
    c.reconcile()
    assert set(hashes(c)) == {0, 1, 2, 3}, "two surge replicas were created in one pass"
    assert hashes(c)[2].isdisjoint(old) and hashes(c)[0] == old, "the old replicas still run"
    assert "Rolling" not in c.reasons() and c.status["readyReplicas"] == 2
    seen = roll(c)
    assert min(seen) == 2, f"never fewer than the 2 replicas asked serving: {seen}"
    assert set(hashes(c)) == {0, 1} and set().union(*hashes(c).values()).isdisjoint(old)
    assert [g["replica"] for g in c.status["groups"]] == [0, 1], "the surge replicas are gone"
    assert c.reasons().count("Rolling") == 2 and c.status["restarts"] == 0


def test_max_unavailable_1_without_surge_takes_one_down_first_even_with_room():
    c = two_replicas("n0 n1 n2 n3", rollout={"maxSurge": 0, "maxUnavailable": 1})
    c.edit(image="img:2")
    c.reconcile()
    assert c.reasons().count("Rolling") == 1 and c.status["readyReplicas"] == 1
    assert set(hashes(c)) <= {0, 1}, "no replica beside the desired ones"
    seen = roll(c)
    assert min(seen) == 1 and c.reasons().count("Rolling") == 2 and c.status["phase"] == "Ready"
    assert set(hashes(c)) == {0, 1}


def test_the_defaults_surge_one_replica_when_there_is_room_and_keep_all_serving():
    c = two_replicas("n0 n1 n2")
    c.edit(image="img:2")
    c.reconcile()
    assert set(hashes(c)) == {0, 1, 2} and c.status["readyReplicas"] == 2
    seen = roll(c)
    assert min(seen) == 2, seen
    assert set(hashes(c)) == {0, 1} and c.reasons().count("Rolling") == 2


def test_the_defaults_on_a_full_cluster_replace_in_place_saying_why_and_never_stall():
    c = two_replicas("n0 n1")
    old = set().union(*hashes(c).values())
    c.edit(image="img:2")
    c.reconcile()
    rolling = [e.message for e in c.events if e.reason == "Rolling"]
    assert len(rolling) == 1 and "no room for a surge replica" in rolling[0], rolling
    assert c.status["readyReplicas"] == 1, "one taken down in the pass that found no room"
    seen = roll(c)
    assert min(seen) >= 1, seen
    assert set(hashes(c)) == {0, 1} and set().union(*hashes(c).values()).isdisjoint(old)
    assert c.status["phase"] == "Ready" and [g["replica"] for g in c.status["groups"]] == [0, 1]


def test_a_new_layout_on_a_full_cluster_rolls_in_place_keeping_one_serving():
    c = Cluster(serving(tensor=4, pipeline=2, replicas=2), rack("n0 n1 n2 n3", "a"))
    c.ready(2)
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 2})
    c.reconcile()
    seen = [c.status["readyReplicas"]] + roll(c)
    assert min(seen) >= 1 and c.status["tensor"] == 8 and c.status["phase"] == "Ready", seen
    assert c.reasons().count("Rolling") == 2


def test_changing_only_the_rollout_policy_rolls_nothing():
    c = two_replicas("n0 n1 n2")
    pods = set(c.pods)
    c.edit(rollout={"maxSurge": 0, "maxUnavailable": 1})
    for _ in range(3):
        c.reconcile()
        c.run_all()
    assert set(c.pods) == pods and "Rolling" not in c.reasons() and c.status["phase"] == "Ready"


@pytest.mark.parametrize("rollout", [{"maxSurge": 0, "maxUnavailable": 0}, {"maxSurge": 0}])
def test_a_rollout_that_could_never_take_a_step_is_refused_in_one_line(rollout):
    with pytest.raises(ValidationError) as refused:
        ShardedModelSpec.model_validate({"model": {"uri": LLAMA_8B["uri"]}, "rollout": rollout})
    message = describe_validation_error(refused.value)
    assert NO_STEP in message and "\n" not in message, message


def test_the_surge_replicas_leave_in_the_pass_the_last_successor_is_ready():
    c = two_replicas("n0 n1")
    c.edit(image="img:2")
    for _ in range(12):
        c.run_all()
        c.reconcile()
        if c.status["phase"] == "Ready" and c.reasons().count("Rolling") == 2:
            break
    assert [g["replica"] for g in c.status["groups"]] == [0, 1], c.status["groups"]
    assert all(g["phase"] == "Ready" for g in c.status["groups"])


def test_a_surge_replica_hands_its_gpus_to_a_successor_that_found_no_room():
    """Two old TP=4 replicas share n0; n1 (added later) is room for one TP=8 surge replica. An old
    replica frees 4 GPUs, not the 8 its successor needs: the surge replica leaves so that the
    successor starts on its GPUs, and the roll finishes in place."""
    c = Cluster(serving(tensor=4, pipeline=1, replicas=2), rack("n0", "a"))
    c.ready(2)
    c.nodes["n1"] = node("n1", "a")
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 2})
    c.reconcile()
    assert set(hashes(c)) == {0, 1, 2}, "a surge replica on n1"
    seen = [c.status["readyReplicas"]] + roll(c, passes=20)
    assert c.status["tensor"] == 8 and c.status["phase"] == "Ready", c.status["message"]
    assert [g["replica"] for g in c.status["groups"]] == [0, 1] and set(hashes(c)) == {0, 1}
    assert min(seen) >= 1, seen
    assert "ScaledDown" in c.reasons() and c.reasons().count("Rolling") == 2
