"""Warm nodes: a re-planned group of a remote model goes back to nodes whose node-local cache holds
its files (status.nodeCache, a preference of the planner), never at the cost of topology, and never
to a node it could not use anyway (no cluster)."""
from __future__ import annotations

from shardwise.crds.modelshape import from_hints
from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.status import NODE_CACHE_MAX_NODES
from shardwise.operator.decide import nodecache
from shardwise.operator.decide.state import parse_state
from shardwise.operator.planning import groups as planning
from tests.operator.builders import k8s_node as node
from tests.operator.test_decide import LLAMA_8B, Cluster

URI = "s3://models/llama-8b"


def remote(tensor=8, pipeline=1, replicas=2, **model) -> dict:
    return {"model": {**LLAMA_8B, "uri": URI, **model},
            "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": replicas},
            "recovery": {"backoffSeconds": 1, "maxRestarts": 5}}


def _plan(spec: dict, nodes: list[dict], warm=()) -> list[list[str]]:
    typed = ShardedModelSpec.model_validate(spec)
    plan = planning.plan_groups(typed, from_hints(typed.model), "ns", "m", {n["metadata"]["name"]: n for n in nodes},
                                [], list(range(typed.parallelism.replicas)), None, [], warm=warm)
    return [[p.node for p in plan.stages_of(r)] for r in range(typed.parallelism.replicas)]


def _lose_a_node_after_a_scale_down(**model) -> Cluster:
    """Two replicas Ready on n0 and w-9, scaled down to one (on n0); a new node a-0 arrives (it sorts
    first by name) and n0 is lost: replica 0 is re-planned."""
    c = Cluster(remote(**model), [node("n0"), node("w-9")])
    c.ready(replicas=2)
    assert sorted(c.nodes_of(0) + c.nodes_of(1)) == ["n0", "w-9"] and c.nodes_of(0) == ["n0"]
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 1})
    c.reconcile()
    c.nodes["a-0"] = node("a-0")
    c.node_down("n0")
    c.reconcile()                      # torn down, backing off
    c.reconcile(seconds=2)             # re-planned
    return c


def test_a_node_loss_replans_the_group_onto_the_node_that_served_it_before():
    c = _lose_a_node_after_a_scale_down()
    assert c.nodes_of(0) == ["w-9"]            # its cache holds the files: no download
    assert c.status["nodeCache"] == {"uri": URI, "nodes": ["n0", "w-9"]}
    # a model whose pods cache in their own emptyDir has nothing on any node: by name, as before
    c = _lose_a_node_after_a_scale_down(cache="pod")
    assert c.nodes_of(0) == ["a-0"] and "nodeCache" not in c.status


def test_the_re_plan_prefers_the_warm_node_where_it_would_otherwise_pick_by_name():
    nodes = [node("a-cold"), node("z-warm"), node("kept")]
    assert _plan(remote(replicas=1), nodes) == [["a-cold"]]
    assert _plan(remote(replicas=1), nodes, warm=["z-warm"]) == [["z-warm"]]


def test_a_warm_node_that_is_not_ready_or_has_no_gpus_is_not_picked():
    nodes = [node("a-cold"), node("z-warm", ready=False), node("y-warm", gpus=0)]
    assert _plan(remote(replicas=1), nodes, warm=["z-warm", "y-warm"]) == [["a-cold"]]


def test_warmth_never_splits_a_replica_across_racks_when_one_rack_holds_it():
    # two warm nodes in different racks against two cold nodes sharing rack c: the stages stay in c
    nodes = [node("a0", "a"), node("b0", "b"), node("c0", "c"), node("c1", "c")]
    assert _plan(remote(pipeline=2, replicas=1), nodes, warm=["a0", "b0"]) == [["c0", "c1"]]
    # and among placements equal in topology it takes the warm ones
    nodes += [node("d0", "d"), node("d1", "d")]
    assert _plan(remote(pipeline=2, replicas=1), nodes, warm=["d0", "d1"]) == [["d0", "d1"]]


def _state(status: dict, pods=(), uri: str = URI, cache: str | None = None, endpoint: str | None = None):
    model = {**LLAMA_8B, "uri": uri, **({"cache": cache} if cache else {}),
             **({"endpoint": endpoint} if endpoint else {})}
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": model, "parallelism": {"tensor": 8}}, "status": status}
    return parse_state(body, list(pods), None, "img:1")


def _ready_pod(state, node_name: str, name: str) -> dict:
    from shardwise.crds import names
    return {"metadata": {"name": name, "labels": {names.LABEL_REPLICA: "0", names.LABEL_STAGE: "0",
                                                  names.LABEL_SPEC_HASH: state.spec_hash},
                         "ownerReferences": [{"uid": "u-1"}]},
            "spec": {"nodeName": node_name},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_list_is_bounded_most_recent_first_and_starts_again_when_the_source_changes():
    full = [f"n{i}" for i in range(NODE_CACHE_MAX_NODES)]
    state = _state({"nodeCache": {"uri": URI, "nodes": full}})
    pod = _ready_pod(state, "fresh", "m-r0-s0-a1")
    after = nodecache.update(_state({"nodeCache": {"uri": URI, "nodes": full}}, [pod]))
    assert after.nodes[0] == "fresh" and len(after.nodes) == NODE_CACHE_MAX_NODES and full[-1] not in after.nodes
    # another uri (or revision) is other files: the list starts again
    moved = nodecache.update(_state({"nodeCache": {"uri": URI, "nodes": full}}, uri=URI + "-v2"))
    assert moved.uri == URI + "-v2" and moved.nodes == []
    # so is the same uri in another store
    moved = nodecache.update(_state({"nodeCache": {"uri": URI, "nodes": full}}, endpoint="http://other:9000"))
    assert moved.endpoint == "http://other:9000" and moved.nodes == []
    # a pod of an older spec (the old uri, still serving during a roll) adds nothing to the new list
    old = _ready_pod(state, "old-node", "m-r0-s0-a1")
    assert nodecache.update(_state({}, [old], uri=URI + "-v2")).nodes == []


def test_entries_that_are_not_node_names_are_dropped_and_pod_caches_keep_no_list():
    forged = {"nodeCache": {"uri": URI, "nodes": ["ok-1", "../etc", "UPPER", "ok-1", "x" * 300]}}
    assert nodecache.update(_state(forged)).nodes == ["ok-1"]
    assert nodecache.update(_state({"nodeCache": {"uri": URI, "nodes": "n1"}})).nodes == []
    assert nodecache.update(_state(forged, cache="pod")) is None
    local = parse_state({"metadata": {"name": "m", "namespace": "ns", "uid": "u-1"},
                         "spec": {"model": LLAMA_8B, "parallelism": {"tensor": 8}}, "status": forged}, [], None)
    assert nodecache.update(local) is None
