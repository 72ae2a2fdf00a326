"""The paged KV cache (worker/serving/kv_blocks.py, model/attention.py KVCache, scheduler.py): block allocation and prefix
reuse as pure bookkeeping, then real ranks: many concurrent requests of different lengths, under a
cache small enough to preempt and with prompts fed in chunks, give the tokens each gives alone;
a shared prompt prefix is prefilled once; a cancelled request gives its blocks back."""
from __future__ import annotations

import random

import pytest

from shardwise.worker.serving.engine import Engine
from shardwise.worker.serving.request import Request
from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.kv_blocks import BlockPool
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from tests.worker.texts import random_prompts

MAX_SEQ = 128


# ---- the allocator alone ----------------------------------------------------------------------
def test_requests_take_their_own_lane_in_order_and_borrow_from_other_lanes_ends():
    pool = BlockPool(num_blocks=12, block_size=4, lanes=3)          # lanes of 4 blocks
    assert [pool.take(1, j) for j in range(4)] == [4, 5, 6, 7]
    # lane 1 is full: the fifth block comes from the end of another lane, not its start
    assert pool.take(1, 4) in (3, 11)
    assert pool.take(0, 0) == 0
    pool.release([4, 5, 6, 7])
    assert pool.available == 12 - 2


def test_a_shared_prefix_is_matched_block_by_block_and_leaves_one_token_to_feed():
    pool = BlockPool(num_blocks=8, block_size=4, lanes=2)
    prompt = list(range(100, 110))                   # 10 tokens: 2 full blocks
    blocks = [pool.take(0, j) for j in range(3)]
    pool.register(prompt, blocks)
    assert pool.match(prompt + [1, 2]) == blocks[:2]
    assert pool.match(prompt[:8]) == blocks[:1]      # 8 tokens cached whole: the last block is fed again
    assert pool.match([100, 101, 102, 999, 104]) == []
    assert pool.match([7] + prompt) == []            # same tokens at other positions: no match


def test_unused_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(num_blocks=4, block_size=2, lanes=1)
    a, b = [pool.take(0, 0), pool.take(0, 1)], [pool.take(0, 2), pool.take(0, 3)]
    pool.register([1, 2, 3, 4], a)
    pool.register([5, 6, 7, 8], b)
    pool.release(a)
    pool.release(b)
    assert pool.available == 4
    pool.release(pool.match([1, 2, 3, 4, 9]))       # a used again: b is now the older
    assert pool.take(0, 0) == b[0]
    assert pool.match([5, 6, 7, 8, 9]) == []         # b's first block is gone, so is its prefix
    assert pool.match([1, 2, 3, 4, 9]) == a


def test_random_operations_keep_every_block_in_exactly_one_state():
    """Against the invariant directly: a block is free, cached-and-unused, or held (refs > 0),
    never two of these, and what is available plus what is held is the whole pool."""
    rng = random.Random(7)
    pool = BlockPool(num_blocks=24, block_size=3, lanes=4)
    held: list[tuple[list[int], list[int]]] = []      # (tokens, blocks) per live request
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
            blocks = pool.match(tokens)
            need = -(-len(tokens) // 3) - len(blocks)
            if need > pool.available:
                pool.release(blocks)
                continue
            lane = rng.randrange(4)
            blocks += [pool.take(lane, len(blocks) + j) for j in range(need)]
            assert None not in blocks and len(set(blocks)) == len(blocks)
            held.append((tokens, blocks))
        elif held:
            tokens, blocks = held.pop(rng.randrange(len(held)))
            pool.register(tokens, blocks)
            pool.release(blocks)
        refs = [0] * 24
        for _, blocks in held:
            for blk in blocks:
                refs[blk] += 1
        assert refs == pool.refs
        free, cached = pool.free, set(pool.evictable)
        assert not free & cached
        assert all(pool.refs[blk] == 0 for blk in free | cached)
        assert len(free) + len(cached) + sum(r > 0 for r in refs) == 24
        assert set(pool.key_of) >= cached


# ---- real ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_3_layers):
    return tiny_3_layers


def alone(ctx, prompts, new_tokens) -> list[list[int]]:
    """Each prompt on its own, in one fixed row of the whole context: the reference."""
    out = []
    for p in prompts:
        engine = Engine(ctx.stage, 1, MAX_SEQ, [], block_size=MAX_SEQ)
        out.append(engine.generate([Request(p, max_new_tokens=new_tokens)])[0].token_ids)
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_concurrent_requests_under_a_small_paged_cache_match_their_answers_alone(tiny, tp, pp):
    prompts = random_prompts(10, seed=tp * 10 + pp)
    with LocalRuntime(RankSpec(tiny, tp, pp, max_batch=6, max_seq=MAX_SEQ)) as ctx:
        want = alone(ctx, prompts, 24)
        # 200 tokens for 10 requests of up to 83 tokens, six at a time: blocks run out, decodes
        # preempt, and prompts are fed 7 tokens a step.
        engine = Engine(ctx.stage, 6, MAX_SEQ, [], kv_tokens=200, block_size=8, prefill_chunk=7)
        reqs = engine.generate([Request(p, max_new_tokens=24) for p in prompts])
        assert [r.token_ids for r in reqs] == want
        assert engine.stats.preempted > 0
        assert engine.pool.available == engine.pool.num_blocks       # every block given back


def test_a_shared_system_prompt_is_prefilled_once(tiny):
    system = random_prompts(1, seed=3)[0] + random_prompts(1, seed=4)[0]          # ~80 tokens
    questions = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with LocalRuntime(RankSpec(tiny, 2, 2, max_batch=4, max_seq=MAX_SEQ)) as ctx:
        want = alone(ctx, [system + q for q in questions], 8)
        engine = Engine(ctx.stage, 4, MAX_SEQ, [], block_size=8)
        first = engine.generate([Request(system + questions[0], max_new_tokens=8)])[0]
        rest = engine.generate([Request(system + q, max_new_tokens=8) for q in questions[1:]])
        assert first.reused_tokens == 0
        assert all(r.reused_tokens == len(system) // 8 * 8 for r in rest)
        assert engine.stats.prefill_tokens == len(system) + sum(map(len, questions)) + \
            2 * (len(system) % 8)
        assert [r.token_ids for r in [first] + rest] == want


def test_requests_that_arrive_together_with_one_system_prompt_prefill_it_once(tiny):
    """The first request's prefill registers its blocks chunk by chunk; the others wait for them
    instead of computing the same keys alongside it."""
    system = random_prompts(1, seed=3)[0] + random_prompts(1, seed=4)[0]
    questions = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with LocalRuntime(RankSpec(tiny, 1, 2, max_batch=4, max_seq=MAX_SEQ)) as ctx:
        want = alone(ctx, [system + q for q in questions], 8)
        engine = Engine(ctx.stage, 4, MAX_SEQ, [], block_size=8, prefill_chunk=32)
        reqs = engine.generate([Request(system + q, max_new_tokens=8) for q in questions])
        assert [r.token_ids for r in reqs] == want
        assert [r.reused_tokens for r in reqs] == [0] + [len(system) // 8 * 8] * 2
        assert engine.stats.prefill_tokens == len(system) + sum(map(len, questions)) + 2 * (len(system) % 8)


def test_a_long_prompt_is_fed_in_chunks_between_the_running_streams_steps(tiny):
    long_prompt = (random_prompts(1, seed=5)[0] * 3 + random_prompts(1, seed=6)[0] * 3)[:100]
    with LocalRuntime(RankSpec(tiny, 1, 1, max_batch=2, max_seq=MAX_SEQ)) as ctx:
        for chunk, most in ((16, None), (MAX_SEQ, 1)):
            engine = Engine(ctx.stage, 2, MAX_SEQ, [], block_size=8, prefill_chunk=chunk)
            stream = engine.submit(Request([1, 2, 3], max_new_tokens=60))
            engine.step()                                            # the stream is decoding
            long = engine.submit(Request(long_prompt, max_new_tokens=1))
            before = len(stream.token_ids)
            while long.first_token_at is None:
                engine.step()
            during = len(stream.token_ids) - before
            chunks = -(-len(long_prompt) // chunk)
            if most is None:
                assert during >= chunks - 1, (during, chunks)        # a token between every two chunks
            else:
                assert during <= most                                # one prefill: the stream waits
            while engine.step():
                pass


def test_a_cancelled_request_gives_its_blocks_back_and_a_waiting_one_never_starts(tiny):
    with LocalRuntime(RankSpec(tiny, 1, 1, max_batch=1, max_seq=MAX_SEQ)) as ctx:
        engine = Engine(ctx.stage, 1, MAX_SEQ, [], block_size=8, prefix_cache=False)
        running = engine.submit(Request(random_prompts(1, seed=8)[0], max_new_tokens=100))
        queued = engine.submit(Request([4, 5, 6], max_new_tokens=100))
        for _ in range(5):
            engine.step()
        assert engine.pool.available < engine.pool.num_blocks
        running.cancel()
        queued.cancel()
        while engine.step():
            pass
        assert running.done.is_set() and queued.done.is_set()
        assert len(running.token_ids) < 10 and queued.token_ids == []
        assert engine.pool.available == engine.pool.num_blocks


def test_a_prompt_larger_than_the_whole_cache_is_refused_in_one_line(tiny):
    with LocalRuntime(RankSpec(tiny, 1, 1, max_batch=2, max_seq=MAX_SEQ)) as ctx:
        engine = Engine(ctx.stage, 2, MAX_SEQ, [], kv_tokens=32, block_size=8)
        with pytest.raises(WorkerError, match=r"^prompt is 40 tokens; the KV cache holds 32 \(--kv-cache-tokens\)$"):
            engine.submit(Request(list(range(3, 43))))
