"""Decode in the shapes a CUDA graph replays (worker/serving/cuda_graphs.py), run on CPU without
the capture: the batch padded to a bucket, every block table padded to the most blocks a sequence
holds, on the paged cache. Under a cache small enough to preempt, with prompts fed in chunks and a
shared system prompt reused from the cache, the engine gives the same greedy tokens as the eager
paged decode."""
from __future__ import annotations

import pytest
import torch

from shardwise.worker.serving.cuda_graphs import GraphedDecode, padded_ints, unpack
from shardwise.worker.serving.engine import Engine
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.serving.request import Request
from tests.worker.texts import random_prompts

MAX_SEQ = 128


@pytest.fixture(scope="module")
def tiny(tiny_3_layers):
    return tiny_3_layers


def _run(stage, prompts: list[list[int]], system: list[int]) -> tuple[Engine, list[Request]]:
    # 200 tokens of 8-token blocks for 10 requests of up to 83 tokens, six at a time: blocks run
    # out and decodes preempt; then four questions after one system prompt, prefilled once
    engine = Engine(stage, 6, MAX_SEQ, [], kv_tokens=200, block_size=8, prefill_chunk=7)
    reqs = engine.generate([Request(p, max_new_tokens=24) for p in prompts])
    engine.generate([Request(system, max_new_tokens=2)])
    reqs += engine.generate([Request(system + q, max_new_tokens=12) for q in ([5, 6, 7], [8, 9], [10], [11, 12])])
    return engine, reqs


def test_graph_shaped_decode_on_the_paged_cache_gives_the_eager_greedy_tokens(tiny):
    prompts, system = random_prompts(10, seed=1), random_prompts(1, seed=3)[0] + random_prompts(1, seed=4)[0]
    with LocalRuntime(RankSpec(tiny, 1, 1, max_batch=6, max_seq=MAX_SEQ)) as ctx:
        stage = ctx.stage
        _, eager = _run(stage, prompts, system)
        stage.graphed = GraphedDecode(stage.model, stage.device)
        try:
            engine, graphed = _run(stage, prompts, system)
            buckets = set(stage.graphed.graphs)
        finally:
            stage.graphed = None
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert engine.block_size == 8 and engine.stats.preempted > 0        # paged, and preempting
    assert all(r.reused_tokens >= len(system) - 8 for r in graphed[-4:])  # the system prompt reused
    assert len(buckets) > 1 and all(n & (n - 1) == 0 for n in buckets)    # padded to buckets
    assert engine.pool.available == engine.pool.num_blocks


def test_padding_rows_and_table_columns_name_the_scratch_block():
    ints = padded_ints(torch.tensor([[17], [3]]), torch.tensor([[4, 9, 2], [5, 0, 0]]), 4, scratch=30, width=5)
    positions, tables = unpack(ints, 4)
    assert positions[:, 0].tolist() == [17, 3, 0, 0]
    assert tables.tolist() == [[4, 9, 2, 30, 30], [5, 0, 0, 30, 30], [30] * 5, [30] * 5]
