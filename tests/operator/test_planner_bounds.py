"""The planner's work is bounded: depths that cannot fit are skipped (same plans as trying each in
turn), a search is capped at MAX_PIPELINE stages, and a pass has a time budget."""
from __future__ import annotations

import itertools
import time

import pytest

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hints
from shardwise.operator.planning import layouts, planner
from tests.operator.builders import gpu_node


def spec_of(layers: int, parameters: int, heads: int = 64, **extra) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({"model": {"uri": "/m", "layers": layers, "heads": heads,
                                                      "parameters": parameters, "hiddenSize": 8192,
                                                      "vocabSize": 128000}, **extra})


def outcome(spec: ShardedModelSpec, nodes) -> tuple:
    try:
        p = planner.plan(spec, from_hints(spec.model, spec.dtype), nodes)
    except planner.PlanError as e:
        return ("refused", type(e).__name__, str(e))
    return ("planned", p.tensor, p.pipeline, p.memory_per_gpu, tuple(p.placements))


def test_a_1024_layer_model_is_planned_or_refused_in_well_under_a_second():
    nodes = [gpu_node(f"n{i}", 8) for i in range(4)]
    for parameters in (10**15, 4 * 10**11, 4 * 10**10):
        spec = spec_of(1024, parameters)
        started = time.monotonic()
        outcome(spec, nodes)
        assert time.monotonic() - started < 5, parameters


@pytest.mark.parametrize("layers,parameters,memory_gib,extra", [
    (l, p, m, e) for (l, p, m), e in itertools.product(
        [(12, 3 * 10**11, 80), (40, 7 * 10**10, 24), (64, 10**12, 80), (30, 8 * 10**9, 16), (48, 10**13, 80)],
        [{}, {"serving": {"kvCacheTokens": 200000}}, {"serving": {"offload": True}},
         {"workload": "training", "training": {"data": "/d", "steps": 1}, "checkpoint": {"claim": "c"},
          "parallelism": {"replicas": 4}}])])
def test_skipping_depths_gives_the_plan_trying_every_depth_gives(monkeypatch, layers, parameters, memory_gib, extra):
    spec = spec_of(layers, parameters, **extra)
    nodes = [gpu_node(f"n{i}", 8, memory_gib=memory_gib) for i in range(6)]
    fast = outcome(spec, nodes)
    monkeypatch.setattr(layouts, "_first_depth", lambda *a: 1)   # the exhaustive search: every depth in turn
    assert outcome(spec, nodes) == fast


def test_the_floor_is_never_above_the_layout_it_bounds():
    for layers, parameters, extra in [(40, 7 * 10**10, {}), (7, 5 * 10**9, {"serving": {"offload": True}}),
                                      (33, 10**11, {"serving": {"kvCacheTokens": 10**6}})]:
        spec = spec_of(layers, parameters, **extra)
        facts = from_hints(spec.model)
        for tensor, pipeline in itertools.product((1, 2, 8), range(1, layers + 1)):
            floor = layouts.stage_memory_floor(facts, spec, tensor, pipeline)
            assert floor <= layouts.make_layout(facts, spec, tensor, pipeline).memory


def test_a_search_past_its_time_budget_ends_in_a_plan_error_saying_so():
    spec = spec_of(64, 10**12)
    with pytest.raises(planner.PlanError) as refused:
        planner.plan(spec, from_hints(spec.model), [gpu_node(f"n{i}", 8) for i in range(4)], seconds=1e-9)
    assert "no plan found within" in str(refused.value) and "\n" not in str(refused.value)


def test_layers_tiny_next_to_the_embedding_split_at_once():
    from shardwise.crds.layout import split_layers
    # within the bounds: a 2^44-parameter embedding and head, layers of one parameter each
    facts = from_hints(spec_of(512, 2 * 2**20 * 2**24 + 2**20 + 512 * 2).model)
    facts = type(facts)(**{**facts.__dict__, "hidden": 2**20, "vocab": 2**24})
    started = time.monotonic()
    for stages in (2, 64, 512):
        ranges, _ = split_layers(facts, stages)
        assert ranges[-1][1] == 512 and len(ranges) == stages
    assert time.monotonic() - started < 5
