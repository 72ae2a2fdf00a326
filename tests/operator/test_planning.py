"""How the operator re-plans one group with the pure planner: same rack when it fits, else the whole
group moves; numbering; other replicas kept (no cluster)."""
from __future__ import annotations

import pytest

from shardwise.crds.models import ModelSource, ShardedModelSpec
from shardwise.operator.planning import groups as planning
from shardwise.crds.modelshape import from_hints
from shardwise.operator.planning.groups import merge_plan
from tests.operator.builders import k8s_node

def _spec(replicas: int = 1, tensor: int = 8, pipeline: int = 2) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({
        "model": {"uri": "/models/x", "parameters": 8_000_000_000, "layers": 32, "heads": 32, "kvHeads": 16,
                  "hiddenSize": 4096, "vocabSize": 128256},
        "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": replicas}})


def _plan_groups(spec: ShardedModelSpec, *args, **kw):
    return planning.plan_groups(spec, from_hints(spec.model), *args, **kw)


def _nodes(*specs) -> dict[str, dict]:
    """(name, rack[, ready[, gpus]]) each."""
    return {s[0]: k8s_node(s[0], s[1], ready=s[2] if len(s) > 2 else True, gpus=s[3] if len(s) > 3 else 8)
            for s in specs}


def test_a_recovering_group_stays_in_its_rack_when_the_rack_has_room():
    first = _plan_groups(_spec(), "ns", "m", _nodes(("z0", "z"), ("z1", "z"), ("z2", "z")), [], [0], None, [])
    old = [p.node for p in first.stages_of(0)]
    # Rack b appears and z1 fails. On its own the planner would take rack b (equal cost, and b sorts
    # first); the operator offers the group its own rack first, and it still fits there.
    nodes = _nodes(("z0", "z"), ("z1", "z", False), ("z2", "z"), ("b0", "b"), ("b1", "b"))
    fresh = _plan_groups(_spec(), "ns", "m", nodes, [], [0], None, [])
    assert {n[0] for n in (p.node for p in fresh.stages_of(0))} == {"b"}
    again = _plan_groups(_spec(), "ns", "m", nodes, [], [0], first, [], previous={0: old})
    new = [p.node for p in again.stages_of(0)]
    assert "z1" not in new and {n[0] for n in new} == {"z"}, (old, new)


def test_the_whole_group_moves_when_its_rack_no_longer_fits_it():
    nodes = _nodes(("a0", "a"), ("a1", "a", False), ("b0", "b"), ("b1", "b"))
    current = _plan_groups(_spec(), "ns", "m", _nodes(("a0", "a"), ("a1", "a"), ("b0", "b"),
                                                               ("b1", "b")), [], [0], None, [])
    old = [p.node for p in current.stages_of(0)]
    again = _plan_groups(_spec(), "ns", "m", nodes, [], [0], current, [], previous={0: old})
    new = [p.node for p in again.stages_of(0)]
    racks = {n[0] for n in new}
    assert len(racks) == 1 and racks != {old[0][0]}, (old, new)


def test_new_group_gets_the_number_asked_for_and_kept_groups_stay_put():
    nodes = _nodes(*[(f"n{i}", "a") for i in range(4)])
    two = _plan_groups(_spec(replicas=2, tensor=8, pipeline=1), "ns", "m", nodes, [], [0, 1], None, [])
    three = _plan_groups(_spec(replicas=3, tensor=8, pipeline=1), "ns", "m", nodes, [], [2], two, [0, 1])
    assert {p.replica for p in three.placements} == {2}
    merged = merge_plan(two, three, {2})
    assert sorted(p.replica for p in merged.placements) == [0, 1, 2]
    assert len({p.node for p in merged.placements}) == 3  # the kept groups' GPUs were not handed out
    assert [p.node for p in merged.stages_of(0)] == [p.node for p in two.stages_of(0)]


def test_spec_errors_and_capacity_errors_are_told_apart_by_type():
    nodes = _nodes(("n0", "a"))
    with pytest.raises(planning.ShortOfCapacity) as capacity:
        _plan_groups(_spec(tensor=16, pipeline=1), "ns", "m", nodes, [], [0], None, [])
    assert "16" in str(capacity.value)
    odd = ShardedModelSpec.model_validate({"model": {"uri": "/m"}, "parallelism": {"tensor": 16, "pipeline": 1}})
    facts = from_hints(ModelSource(uri="/m", parameters=10**9, layers=8, heads=24, kv_heads=8))
    with pytest.raises(planning.InvalidSpec) as invalid:
        planning.plan_groups(odd, facts, "ns", "m", _nodes(("big", "a", True, 16)), [], [0], None, [])
    assert "does not divide" in str(invalid.value)
