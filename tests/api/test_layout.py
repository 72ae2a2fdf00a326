"""The one rank formula and the one layer split (crds/layout.py), which the planner and the worker share."""
from __future__ import annotations

import itertools

import pytest

from shardwise.crds.layout import RankLayout, RankPosition, split_layers
from shardwise.crds.modelshape import from_hf_config
from shardwise.crds.plan import ShardPlan

SMOL = from_hf_config(dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                           intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True))


@pytest.mark.parametrize("tensor,pipeline,replicas", [(1, 1, 1), (2, 3, 1), (4, 2, 3), (3, 1, 2)])
def test_ranks_and_positions_are_inverse_and_stage_major(tensor, pipeline, replicas):
    layout = RankLayout(tensor, pipeline, replicas)
    assert layout.world_size == tensor * pipeline * replicas
    ranks = [layout.rank(r, s, t) for r, s, t in itertools.product(range(replicas), range(pipeline), range(tensor))]
    assert ranks == list(range(layout.world_size))   # replica, then stage, then TP rank
    assert all(layout.position(layout.rank(*p)) == RankPosition(*p)
               for p in itertools.product(range(replicas), range(pipeline), range(tensor)))
    assert layout.stage_ranks(pipeline - 1, replicas - 1) == ranks[-tensor:]


def test_out_of_range_positions_are_refused():
    layout = RankLayout(2, 3)
    with pytest.raises(ValueError, match="stage 3 is outside 0..2"):
        layout.rank(0, 3, 0)
    with pytest.raises(ValueError, match="rank 6 is outside 0..5"):
        layout.position(6)
    with pytest.raises(ValueError, match="must each be at least 1"):
        RankLayout(0, 1)


def test_a_plans_world_is_one_replica():
    plan = ShardPlan(tensor=2, pipeline=3, replicas=4, num_layers=6)
    assert plan.world_size == RankLayout(2, 3).world_size == 6


def test_one_stage_holds_every_parameter_once():
    """A tied head on the embedding's own stage is the embedding: counted once, as the worker loads it."""
    (ranges, params) = split_layers(SMOL, 1)
    assert ranges == ((0, 30),) and abs(params[0] - SMOL.params) < SMOL.layers


def test_the_worker_splits_as_the_planner_does():
    """`shardwise generate -p P` and a pipeline-P pod get the same layer ranges."""
    pytest.importorskip("torch")
    from shardwise.worker.model.llama import ModelConfig

    config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, tie_word_embeddings=True)
    for stages in range(1, 7):
        assert split_layers(config.facts(), stages) == split_layers(SMOL, stages)
    ranges = split_layers(SMOL, 3).ranges
    assert ranges[0][1] - ranges[0][0] < ranges[1][1] - ranges[1][0]   # the embedding stage holds fewer layers


def test_more_stages_than_layers_is_a_value_error():
    with pytest.raises(ValueError, match="pipeline 31 exceeds the model's 30 layers"):
        split_layers(SMOL, 31)
