"""The planner: properties on random inventories (hypothesis) and the behaviour a user reads."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.crds.layout import split_layers
from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import ModelFacts, from_hf_config
from shardwise.operator.planning.inventory import NodeInfo, Taint
from shardwise.operator.planning.planner import GiB, PlanError, plan
from tests.operator.builders import RACK, ZONE
from tests.operator.builders import gpu_node as node


LLAMA_70B = from_hf_config(dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                hidden_size=8192, intermediate_size=28672, vocab_size=128256), "bfloat16")
LLAMA_405B = from_hf_config(dict(num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                                 hidden_size=16384, intermediate_size=53248, vocab_size=128256), "bfloat16")
SMOL = from_hf_config(dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           hidden_size=576, intermediate_size=1536, vocab_size=49152,
                           tie_word_embeddings=True), "bfloat16")
# A tiny model for placement properties: fits any slot, 12 layers, 8 heads.
TINY = ModelFacts(layers=12, heads=8, kv_heads=8, hidden=64, vocab=100, intermediate=256,
                  params=12 * 50_000 + 2 * 6400 + 64, bytes_per_param=2)


def spec(**parallelism) -> ShardedModelSpec:
    extra = parallelism.pop("spec", {})
    return ShardedModelSpec.model_validate({"model": {"uri": "/models/m"}, "parallelism": parallelism, **extra})


# ------------------------------------------------------------------ random inventories

@st.composite
def inventories(draw, max_nodes: int = 24, max_gpus: int = 8):
    count = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(count):
        zone = draw(st.sampled_from(["za", "zb", "zc"]))
        rack = zone + draw(st.sampled_from(["-r1", "-r2"]))
        gpus = draw(st.sampled_from([max_gpus, max_gpus // 2 or 1]))
        free = draw(st.integers(0, gpus))
        nodes.append(node(f"n{i:02d}", free, zone, rack, gpus=gpus))
    return nodes


def check_capacity(result, nodes):
    by_name = {n.name: n for n in nodes}
    taken: dict[str, int] = {}
    for p in result.placements:
        taken[p.node] = taken.get(p.node, 0) + p.gpus
    for name, gpus in taken.items():
        assert gpus <= by_name[name].free, f"{name}: {gpus} GPUs placed, {by_name[name].free} free"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=inventories(), tensor=st.sampled_from([1, 2, 4, 8]), pipeline=st.integers(1, 4),
       replicas=st.integers(0, 6), shrink=st.booleans())
def test_capacity_never_exceeded_and_tp_groups_stay_on_one_node(nodes, tensor, pipeline, replicas, shrink):
    s = spec(tensor=tensor, pipeline=pipeline, replicas=replicas, spec={"recovery": {"allowShrink": shrink}})
    try:
        result = plan(s, TINY, nodes)
    except PlanError as e:
        slots = sum(n.free // tensor for n in nodes)
        assert slots < pipeline * replicas or (shrink and slots < pipeline), str(e)
        assert "\n" not in str(e)
        return
    check_capacity(result, nodes)
    assert all(p.gpus == tensor for p in result.placements)   # one pod = one whole TP group
    assert result.replicas == len({p.replica for p in result.placements})
    assert result.replicas == replicas or (shrink and result.shrunk and result.replicas < replicas)
    assert result.cost == sum(g.cost for g in result.groups)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=inventories(max_nodes=12), memories=st.lists(st.sampled_from([24, 40, 80, 141]), min_size=12, max_size=12),
       replicas=st.integers(1, 3))
def test_chosen_layout_fits_the_memory_of_the_gpus_it_lands_on(nodes, memories, replicas):
    nodes = [dataclasses.replace(n, gpu_memory=m * GiB) for n, m in zip(nodes, memories)]
    s = spec(replicas=replicas, spec={"recovery": {"allowShrink": True}})
    try:
        result = plan(s, LLAMA_70B, nodes)
    except PlanError as e:
        assert "\n" not in str(e)
        return
    by_name = {n.name: n for n in nodes}
    assert LLAMA_70B.heads % result.tensor == 0 and LLAMA_70B.kv_heads % result.tensor == 0
    for p in result.placements:
        assert result.memory_per_gpu <= 0.9 * by_name[p.node].gpu_memory
    check_capacity(result, nodes)


def _distance(a: NodeInfo, b: NodeInfo) -> int:
    """Boundaries between two nodes, written independently of the planner: node, rack, zone."""
    if a.name == b.name:
        return 0
    if a.labels[ZONE] != b.labels[ZONE]:
        return 3
    return 2 if a.labels[RACK] != b.labels[RACK] else 1


def _brute_force(nodes: list[NodeInfo], tensor: int, pipeline: int, replicas: int) -> int | None:
    """Least total cost over every assignment of every stage of every replica, or None."""
    slots = {n.name: n.free // tensor for n in nodes}
    names = [n.name for n in nodes if slots[n.name]]
    by_name = {n.name: n for n in nodes}
    groups = []  # (multiset of nodes, cheapest ordering's cost)
    for combo in itertools.combinations_with_replacement(names, pipeline):
        cost = min(sum(_distance(by_name[a], by_name[b]) for a, b in zip(order, order[1:]))
                   for order in set(itertools.permutations(combo)))
        groups.append((combo, cost))
    best = None

    def search(start: int, left: int, used: dict[str, int], total: int):
        nonlocal best
        if best is not None and total >= best:
            return
        if left == 0:
            best = total
            return
        for i in range(start, len(groups)):  # replicas are interchangeable: non-decreasing order
            combo, cost = groups[i]
            need: dict[str, int] = {}
            for name in combo:
                need[name] = need.get(name, 0) + 1
            if all(used.get(k, 0) + v <= slots[k] for k, v in need.items()):
                for k, v in need.items():
                    used[k] = used.get(k, 0) + v
                search(i, left - 1, used, total + cost)
                for k, v in need.items():
                    used[k] -= v

    search(0, replicas, {}, 0)
    return best


@st.composite
def tight_cases(draw):
    """Small inventories with about as many replicas as fit: where placing them one by one can go wrong."""
    nodes = draw(inventories(max_nodes=5, max_gpus=4))
    tensor = draw(st.sampled_from([1, 2]))
    pipeline = draw(st.sampled_from([1, 2, 3, 3]))
    fit = sum(n.free // tensor for n in nodes) // pipeline
    replicas = min(4, max(1, fit)) + draw(st.sampled_from([0] * 9 + [-1, 1]))  # now and then one more than fits
    return nodes, tensor, pipeline, max(1, replicas)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tight_cases())
def test_plan_cost_equals_exhaustive_optimum_on_small_inventories(case):
    nodes, tensor, pipeline, replicas = case
    optimum = _brute_force(nodes, tensor, pipeline, replicas)
    s = spec(tensor=tensor, pipeline=pipeline, replicas=replicas)
    if optimum is None:
        with pytest.raises(PlanError):
            plan(s, TINY, nodes)
        return
    result = plan(s, TINY, nodes)
    assert result.cost == optimum
    for group in result.groups:  # each replica's reported cost is its stages' real crossings
        stages = [dict((n.name, n) for n in nodes)[p.node] for p in result.stages_of(group.replica)]
        assert group.cost == sum(_distance(a, b) for a, b in zip(stages, stages[1:]))


@settings(max_examples=50, deadline=None)
@given(nodes=inventories(), seed=st.integers(0, 1000))
def test_plan_is_deterministic_whatever_the_node_order(nodes, seed):
    s = spec(tensor=2, pipeline=2, replicas=2, spec={"recovery": {"allowShrink": True}})
    shuffled = list(nodes)
    random.Random(seed).shuffle(shuffled)
    try:
        first = plan(s, TINY, nodes)
    except PlanError as e:
        with pytest.raises(PlanError) as again:
            plan(s, TINY, shuffled)
        assert str(again.value) == str(e)
        return
    assert plan(s, TINY, shuffled) == first == plan(s, TINY, nodes)


# ------------------------------------------------------------------ layout choice


def test_small_model_gets_one_gpu():
    result = plan(spec(), SMOL, [node("n1", 8)])
    assert (result.tensor, result.pipeline, result.replicas) == (1, 1, 1)


def test_70b_gets_the_smallest_tensor_degree_that_fits_one_node():
    result = plan(spec(), LLAMA_70B, [node("n1", 8)])
    assert result.pipeline == 1 and result.tensor in (2, 4)
    assert result.memory_per_gpu <= 0.9 * 80 * GiB
    smaller = plan(spec(tensor=result.tensor // 2, pipeline=1, spec={"recovery": {"allowShrink": True}}),
                   LLAMA_70B, [node("n1", 8, memory_gib=10_000)])
    assert smaller.memory_per_gpu > 0.9 * 80 * GiB  # the next smaller degree would not have fitted


def test_405b_keeps_tensor_inside_the_node_and_adds_pipeline_stages_in_one_rack():
    nodes = [node(f"a{i}", 8, "z1", "r1") for i in range(2)] + [node(f"b{i}", 8, "z2", "r2") for i in range(4)]
    result = plan(spec(), LLAMA_405B, nodes)
    assert result.tensor == 8 and result.pipeline == 2
    assert len({p.domains[RACK] for p in result.placements}) == 1 and result.cost == 1
    assert result.groups[0].domain.startswith(f"{RACK}=")


def test_fragmented_nodes_get_more_stages_instead_of_a_split_tp_group():
    nodes = [node(f"n{i}", 4) for i in range(4)]  # 4 free GPUs per node, 70B needs ~140 GiB
    result = plan(spec(), LLAMA_70B, nodes)
    assert result.tensor <= 4
    check_capacity(result, nodes)


def test_tensor_that_fits_no_node_is_refused_in_one_sentence():
    nodes = [node("node-1", 2), node("node-2", 3), node("node-3", 4)]
    with pytest.raises(PlanError) as e:
        plan(spec(tensor=8), LLAMA_70B, nodes)
    assert str(e.value) == "needs 8 GPUs in one NVLink domain; the largest free block is 4 on node-3"


def test_tensor_not_dividing_heads_is_refused():
    with pytest.raises(PlanError, match="tensor 2 does not divide the model's 9 attention heads"):
        plan(spec(tensor=2), SMOL, [node("n1", 8)])


def test_model_too_big_for_any_gpu_says_how_much_it_needs():
    with pytest.raises(PlanError, match=r"needs [0-9.]+ GiB per GPU at tensor 1 × pipeline 1; the largest GPUs have 16 GiB"):
        plan(spec(tensor=1, pipeline=1), LLAMA_70B, [node("n1", 8, memory_gib=16)])


# ------------------------------------------------------------------ topology


def test_stages_go_to_the_tightest_domain_and_replicas_spread_across_zones():
    nodes = ([node(f"a{i}", 8, "za", "za-r1") for i in range(3)] + [node(f"b{i}", 8, "zb", "zb-r1") for i in range(3)])
    result = plan(spec(tensor=8, pipeline=2, replicas=2), TINY, nodes)
    zones = [{p.domains[ZONE] for p in result.stages_of(r)} for r in range(2)]
    assert all(len(z) == 1 for z in zones) and zones[0] != zones[1]
    assert result.cost == 2 and all(g.cost == 1 for g in result.groups)
    assert "cost 1 (1 node boundary)" in result.groups[0].explanation


def test_training_replicas_pack_into_one_zone_where_serving_replicas_spread():
    """Data-parallel replicas all-reduce their gradients every step: a training job keeps them in
    the tightest domain that holds it, where serving replicas spread for availability."""
    nodes = ([node(f"a{i}", 8, "za", "za-r1") for i in range(4)] + [node(f"b{i}", 8, "zb", "zb-r1") for i in range(4)])
    training = {"workload": "training", "training": {"data": "/d.txt", "steps": 1}, "checkpoint": {"claim": "c"}}
    packed = plan(spec(tensor=8, pipeline=2, replicas=2, spec=training), TINY, nodes)
    spread = plan(spec(tensor=8, pipeline=2, replicas=2), TINY, nodes)
    assert len({p.domains[ZONE] for p in packed.placements}) == 1
    assert len({p.domains[ZONE] for p in spread.placements}) == 2
    assert packed.cost == spread.cost == 2     # each replica still in one rack: the same boundaries


def test_a_zone_crossing_is_reported_when_nothing_tighter_fits():
    nodes = [node("a0", 8, "za", "za-r1"), node("b0", 8, "zb", "zb-r1")]
    result = plan(spec(tensor=8, pipeline=2), TINY, nodes)
    assert result.cost == 3 and result.groups[0].domain == ""
    assert "1 node boundary, 1 rack boundary, 1 zone boundary" in result.groups[0].explanation


def test_cordoned_not_ready_tainted_and_full_nodes_are_left_out():
    nodes = [node("cordoned", 8, unschedulable=True), node("down", 8, ready=False),
             node("tainted", 8, taints=(Taint("dedicated", "training", "NoSchedule"),)),
             node("full", 0), node("ok", 8)]
    result = plan(spec(tensor=8, replicas=1), TINY, nodes)
    assert [p.node for p in result.placements] == ["ok"]
    assert "left out 4 node(s)" in " ".join(result.notes)
    tolerating = spec(tensor=8, replicas=2, spec={"placement": {"tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}]}})
    assert {p.node for p in plan(tolerating, TINY, nodes).placements} == {"ok", "tainted"}
    with pytest.raises(PlanError, match="needs 2 replica"):
        plan(spec(tensor=8, replicas=2), TINY, nodes)


def test_node_selector_product_and_min_memory_filter_nodes():
    nodes = [node("small", 8, memory_gib=24), dataclasses.replace(node("big", 8), labels={
        **node("big", 8).labels, "nvidia.com/gpu.product": "H100", "pool": "a"})]
    s = spec(tensor=1, spec={"gpu": {"product": "H100", "minMemory": "40Gi"}, "placement": {"nodeSelector": {"pool": "a"}}})
    assert [p.node for p in plan(s, TINY, nodes).placements] == ["big"]


# ------------------------------------------------------------------ re-planning and shrinking


def test_replan_keeps_healthy_replicas_and_moves_only_the_lost_one():
    nodes = [node(f"n{i}", 8, "z1", f"r{i % 2}") for i in range(4)]
    s = spec(tensor=8, pipeline=1, replicas=3)
    first = plan(s, TINY, nodes)
    lost = first.placement(1, 0).node
    survivors = [dataclasses.replace(n, ready=False) if n.name == lost else n for n in nodes]
    keep = [p for p in first.placements if p.replica != 1]
    second = plan(s, TINY, survivors, keep=keep)
    for p in keep:
        assert second.placement(p.replica, p.stage).node == p.node
    assert second.placement(1, 0).node not in {lost, *(p.node for p in keep)}
    check_capacity(second, survivors)


def test_keeping_a_replica_on_a_lost_node_is_refused():
    nodes = [node("n0", 8), node("n1", 8)]
    first = plan(spec(tensor=8, replicas=2), TINY, nodes)
    on_n0 = next(p.replica for p in first.placements if p.node == "n0")
    with pytest.raises(PlanError, match=f"replica {on_n0} cannot be kept: node n0 is not usable"):
        plan(spec(tensor=8, replicas=2), TINY, [dataclasses.replace(nodes[0], ready=False), nodes[1]],
             keep=first.placements)


def test_shrink_only_when_allowed():
    nodes = [node("n0", 8), node("n1", 8)]
    with pytest.raises(PlanError, match="needs 3 replica"):
        plan(spec(tensor=8, replicas=3), TINY, nodes)
    result = plan(spec(tensor=8, replicas=3, spec={"recovery": {"allowShrink": True}}), TINY, nodes)
    assert result.shrunk and result.replicas == 2
    assert any("shrunk to 2 of 3" in n for n in result.notes)


def test_zero_replicas_is_an_empty_plan():
    assert plan(spec(replicas=0), TINY, []).placements == []


# ------------------------------------------------------------------ layer split


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 24), stages=st.integers(1, 6), emb=st.integers(0, 300), head=st.integers(0, 300))
def test_layer_split_is_contiguous_and_as_balanced_as_possible(layers, stages, emb, head):
    if stages > layers:
        return
    facts = ModelFacts(layers=layers, heads=1, kv_heads=1, hidden=1, vocab=emb, intermediate=1,
                       params=emb + head + 1 + layers * 100 + emb, bytes_per_param=2)
    facts = dataclasses.replace(facts, params=emb + 1 + emb + layers * 100, vocab=emb)
    ranges, params = split_layers(facts, stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:] + ((layers, layers + 1),)))
    per, e, h = facts.layer_params, facts.embedding_params, facts.head_params
    best = min(max([e + c[0] * per] + [x * per for x in c[1:-1]] + [h + c[-1] * per] if stages > 1 else [e + h + layers * per])
               for c in _compositions(layers, stages))
    assert max(params) == best


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [b - a for a, b in zip(edges, edges[1:])]


def test_embedding_and_head_live_on_the_first_and_last_stage():
    result = plan(spec(tensor=1, pipeline=3), SMOL, [node("n1", 8)])
    stages = result.stages_of(0)
    assert stages[0].embedding and not stages[0].head and stages[-1].head and not stages[1].embedding
    assert stages[0].layer_end - stages[0].layer_start <= stages[1].layer_end - stages[1].layer_start
