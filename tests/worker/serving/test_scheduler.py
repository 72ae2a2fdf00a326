"""The scheduler's decisions alone (worker/serving/scheduler.py), without torch and without ranks:
admission order, the bounded queue (counted in choices, cancelled ones not counted and dropped
wherever they stand), the refusal of a prompt the cache cannot hold, the choice of the request to
preempt, prompt chunks taking turns with decodes, cancellation, how requests end, and every block
coming back. Steps are "run" by handing each row a made-up token, as the engine hands the sampler's."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from collections import deque

import pytest

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.kv_blocks import BlockPool
from shardwise.worker.serving.request import FinishReason, Request
from shardwise.worker.serving.scheduler import QueueFull, Scheduler, Step

TOKEN = 7        # what every made-up step samples


def _scheduler(rows: int = 2, blocks: int = 16, block_size: int = 4, max_seq: int = 64, micro_batches: int = 1,
               chunk: int = 512, prefix_cache: bool = True, eos: tuple[int, ...] = (),
               max_waiting: int | None = None, budget: int = 512) -> Scheduler:
    pool = BlockPool(blocks, block_size, lanes=rows, prefix_cache=prefix_cache)
    return Scheduler(pool, rows, max_seq, micro_batches, chunk, eos, max_waiting=max_waiting,
                     max_step_tokens=budget)


def _submit(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.check(r)
        s.add([r])


class _Loop:
    """Engine.step with the stages and the sampler left out: launched steps complete in order."""

    def __init__(self, s: Scheduler):
        self.s, self.inflight, self.launched = s, deque(), []

    def step(self) -> bool:
        for mb in range(self.s.micro_batches):
            if not self.s.busy[mb]:
                step = self.s.schedule(mb)
                if step is not None:
                    self.inflight.append(step)
                    self.launched.append(step)
        if not self.inflight:
            return False
        step = self.inflight.popleft()
        if self.s.complete(step):
            self.s.append_tokens(step, [TOKEN] * len(step.ready))
        return True

    def run(self) -> list[Step]:
        while self.step():
            pass
        return self.launched


def test_the_scheduler_imports_without_torch():
    code = "import sys, shardwise.worker.serving.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=os.environ.copy()).returncode == 0


def test_requests_are_admitted_first_come_first_served():
    s = _scheduler(rows=1)
    reqs = [Request([10 + i, 20 + i, 30 + i], max_new_tokens=2) for i in range(3)]
    _submit(s, *reqs)
    steps = _Loop(s).run()
    order = []
    for step in steps:
        order += [r.id for r in step.requests if r.id not in order]
    assert order == [r.id for r in reqs]
    assert all(r.token_ids == [TOKEN, TOKEN] and r.finish_reason == FinishReason.LENGTH for r in reqs)


def test_a_request_waits_while_the_cache_lacks_its_prompts_blocks():
    s = _scheduler(rows=2, blocks=4, block_size=4, prefix_cache=False)
    big, small = Request(list(range(1, 13)), max_new_tokens=1), Request([1, 2], max_new_tokens=1)
    _submit(s, big, small)
    first = s.schedule(0)
    # the 12-token prompt takes 3 of the 4 blocks; the next needs 1 and gets it, in the next row,
    # and both prompts are fed in the same step
    assert first.requests == [big, small] and s.running == 2 and not s.waiting
    later = _scheduler(rows=2, blocks=4, block_size=4, prefix_cache=False)
    _submit(later, Request(list(range(1, 13)), max_new_tokens=1), Request(list(range(1, 9)), max_new_tokens=1))
    later.schedule(0)
    assert later.running == 1 and len(later.waiting) == 1          # 3 + 2 blocks > 4: it waits


@pytest.mark.parametrize("prompt,max_new,message", [
    ([], 1, "prompt is empty"),
    (list(range(64)), 1, "prompt is 64 tokens; the context holds 64 (prompt plus at least one generated token)"),
    ([1, 2], 0, "max_tokens must be at least 1"),
    (list(range(3, 43)), 1, "prompt is 40 tokens; the KV cache holds 32 (--kv-cache-tokens)"),
])
def test_a_request_that_can_never_run_is_refused_in_one_line(prompt, max_new, message):
    s = _scheduler(rows=2, blocks=4, block_size=8, max_seq=64)
    with pytest.raises(WorkerError, match=f"^{re.escape(message)}$"):
        s.check(Request(prompt, max_new_tokens=max_new))


def test_preemption_takes_the_requests_admitted_last_among_those_with_no_step_in_flight():
    # Two micro-batches of three rows; six one-block prompts fill the six blocks.
    s = _scheduler(rows=6, blocks=6, block_size=2, micro_batches=2)
    a, b, c, d, e, f = reqs = [Request([10 + i, 20 + i], max_new_tokens=4) for i in range(6)]
    _submit(s, *reqs)
    first, second = s.schedule(0), s.schedule(1)          # a, b, c in micro-batch 0; d, e, f in 1
    assert first.requests == [a, b, c] and second.requests == [d, e, f] and s.running == 6
    assert first.counts == [2, 2, 2] and first.decodes == 0      # three prompts in one step
    assert s.complete(first)
    s.append_tokens(first, [TOKEN] * 3)
    # a, b and c each need a block for their next position. d, e and f were admitted later, but
    # micro-batch 1 is in flight: a takes c's block, and b, now the last admitted of those
    # idle, steps back itself rather than take the block of a, admitted before it.
    step = s.schedule(0)
    assert step.requests == [a] and step.decodes == 1 and step.counts == [1]
    assert s.stats.preempted == 2 and [q.req for q in s.waiting] == [b, c]
    assert [q.req for q in s.rows if q is not None] == [a, d, e, f]


def test_a_preempted_request_resumes_with_its_tokens_and_every_block_comes_back():
    rng = random.Random(3)
    s = _scheduler(rows=4, blocks=12, block_size=4, max_seq=64, micro_batches=2, chunk=5)
    reqs = [Request([rng.randrange(1, 50) for _ in range(rng.randrange(2, 20))], max_new_tokens=rng.randrange(1, 20))
            for _ in range(12)]
    _submit(s, *reqs)
    _Loop(s).run()
    assert s.stats.preempted > 0
    assert all(r.done.is_set() and r.token_ids == [TOKEN] * r.max_new_tokens for r in reqs)
    assert s.pool.available == s.pool.num_blocks and s.running == 0 and not s.waiting


def test_every_step_decodes_the_running_streams_beside_a_long_prompts_chunks():
    s = _scheduler(rows=2, blocks=32, chunk=4)
    stream = Request([1, 2, 3], max_new_tokens=50)
    _submit(s, stream)
    loop = _Loop(s)
    loop.step()                                            # the stream's prompt: it decodes now
    long = Request(list(range(100, 120)), max_new_tokens=1)
    _submit(s, long)
    loop.launched.clear()
    while long.first_token_at is None:
        loop.step()
    # 20 tokens: 5 chunks of 4, each in the same step as one of the stream's tokens
    assert [st.requests for st in loop.launched] == [[stream, long]] * 5
    assert [st.counts for st in loop.launched] == [[1, 4]] * 5
    assert [st.logits for st in loop.launched] == [[1, 0]] * 4 + [[1, 1]]
    assert len(stream.token_ids) == 1 + 5


def _steady(s: Scheduler, running: int) -> tuple[_Loop, list[Request]]:
    """`running` requests decoding (prompts fed), with room for more."""
    streams = [Request([1, 2, 3 + i], max_new_tokens=100) for i in range(running)]
    _submit(s, *streams)
    loop = _Loop(s)
    while not all(r.token_ids for r in streams):
        loop.step()
    return loop, streams


def test_a_step_feeds_every_decode_and_the_chunks_of_several_prompts_within_its_budget():
    s = _scheduler(rows=8, blocks=128, block_size=4, max_seq=128, chunk=16, budget=40)
    loop, streams = _steady(s, 3)
    prompts = [Request(list(range(10 * i + 1, 10 * i + 1 + n)), max_new_tokens=2) for i, n in enumerate((30, 12, 25))]
    _submit(s, *prompts)
    loop.launched.clear()
    while any(r.first_token_at is None for r in prompts):
        loop.step()
    # 3 decodes, then chunks of at most 16 oldest prompt first, while 40 tokens last
    assert [st.counts for st in loop.launched] == [[1, 1, 1, 16, 12, 9], [1, 1, 1, 1, 14, 16]]
    first, second = loop.launched
    assert first.requests == streams + prompts and first.logits == [1, 1, 1, 0, 1, 0]
    assert second.requests == streams + [prompts[1], prompts[0], prompts[2]]     # prompts[1] decodes now
    assert second.logits == [1] * 6 and second.decodes == 4
    assert all(sum(st.counts) <= 40 for st in loop.launched)


def test_a_budget_below_the_rows_is_raised_so_that_prompts_beside_full_decodes_still_advance():
    s = _scheduler(rows=6, blocks=128, block_size=4, max_seq=128, chunk=16, budget=4)
    assert s.max_step_tokens == 7
    loop, streams = _steady(s, 6)                   # would starve the last prompts at 4 tokens a step
    assert max(len(r.token_ids) for r in streams) < 8
    loop.launched.clear()
    loop.step()
    assert loop.launched[0].requests == streams and loop.launched[0].counts == [1] * 6


def test_random_workloads_keep_the_budget_and_give_every_block_back():
    rng = random.Random(11)
    for budget, chunk, mbs in ((7, 5, 1), (32, 8, 2), (64, 64, 1)):
        s = _scheduler(rows=4, blocks=14, block_size=4, max_seq=64, micro_batches=mbs, chunk=chunk, budget=budget)
        reqs = [Request([rng.randrange(1, 30) for _ in range(rng.randrange(2, 30))],
                        max_new_tokens=rng.randrange(1, 15)) for _ in range(16)]
        _submit(s, *reqs)
        for st in _Loop(s).run():
            assert sum(st.counts) <= max(budget, st.decodes)
            assert all(c <= chunk for c in st.counts[st.decodes:])
            assert len({id(q) for q in st.seqs}) == len(st.seqs)
        assert all(r.done.is_set() and r.token_ids == [TOKEN] * r.max_new_tokens for r in reqs)
        assert s.pool.available == s.pool.num_blocks and s.running == 0 and not s.waiting
        assert sum(s.pool.refs) == 0


def test_a_draft_is_fed_in_its_row_with_the_logits_of_each_position_and_its_kept_prefix_counts():
    s = _scheduler(rows=2, blocks=32, block_size=4, max_seq=64, budget=64)
    loop, (stream,) = _steady(s, 1)
    seq = next(q for q in s.rows if q is not None)
    seq.draft = [40, 41, 42]
    step = s.schedule(0)
    assert step.tokens == [[TOKEN, 40, 41, 42]] and step.starts == [3] and step.logits == [4]
    assert seq.draft == []                                  # proposed anew before each step
    assert s.complete(step) and seq.fed == 4
    s.append_tokens(step, [[40, 41, 9]])                    # two drafts accepted, then a token of its own
    assert stream.token_ids == [TOKEN, 40, 41, 9] and seq.fed == 6
    nxt = s.schedule(0)
    assert nxt.tokens == [[9]] and nxt.starts == [6]        # fed from the first position not cached
    s.complete(nxt)
    with pytest.raises(ValueError):
        s.append_tokens(nxt, [[5, 6]])                      # no draft fed: one token only


def test_a_cancelled_request_ends_and_a_cancelled_queued_one_never_starts():
    s = _scheduler(rows=1, prefix_cache=False)
    running, queued = Request([1, 2, 3], max_new_tokens=100), Request([4, 5, 6], max_new_tokens=100)
    _submit(s, running, queued)
    loop = _Loop(s)
    for _ in range(5):
        loop.step()
    assert s.pool.available < s.pool.num_blocks
    running.cancel()
    queued.cancel()
    loop.run()
    assert running.done.is_set() and queued.done.is_set()
    assert running.finish_reason == queued.finish_reason == FinishReason.STOP
    assert len(running.token_ids) < 10 and queued.token_ids == []
    assert all(queued not in st.requests for st in loop.launched)
    assert s.pool.available == s.pool.num_blocks and s.running == 0


def test_the_queue_is_bounded_in_choices_and_a_submission_is_taken_whole_or_not_at_all():
    s = _scheduler(rows=1, max_waiting=4)
    first, three = Request([1, 2]), [Request([3, 4]) for _ in range(3)]
    s.add([first])
    s.add(three)                                    # 4 waiting: the bound
    with pytest.raises(QueueFull, match="4 choices are waiting .*--max-waiting") as e:
        s.add([Request([5, 6])])
    assert e.value.retry_after >= 1
    with pytest.raises(QueueFull):
        s.check(Request([5, 6]))                    # the same answer before a submission
    with pytest.raises(WorkerError, match="n is 5; this server queues at most 4") as e:
        s.check(Request([5, 6]), sequences=5)       # can never fit: not a QueueFull
    assert not isinstance(e.value, QueueFull)
    assert len(s.waiting) == 4 and s.stats.rejected == 2
    three[0].cancel()                               # a client that went away holds no place
    pair = [Request([7, 8]), Request([7, 8])]
    with pytest.raises(QueueFull):
        s.add(pair)                                 # 3 + 2: neither is queued
    s.add(pair[:1])
    assert [q.req for q in s.waiting] == [first, *three, pair[0]]
    _Loop(s).run()
    assert all(r.done.is_set() for r in [first, *three, pair[0]]) and three[0].token_ids == []


def test_cancelled_requests_leave_the_queue_at_once_wherever_they_stand():
    s = _scheduler(rows=1, max_waiting=8)
    running, live = Request([1, 2, 3], max_new_tokens=100), Request([4, 5, 6], max_new_tokens=100)
    gone = [Request([7, 8, 9], max_new_tokens=100) for _ in range(5)]
    _submit(s, running, live, *gone)
    loop = _Loop(s)
    loop.step()
    assert s.running == 1 and len(s.waiting) == 6
    for r in gone:
        r.cancel()
    loop.step()                                     # the live one still waits for the row
    assert [q.req for q in s.waiting] == [live] and s.running == 1
    assert all(r.done.is_set() and r.finish_reason == FinishReason.STOP and r.token_ids == [] for r in gone)
    assert not running.done.is_set()


def test_requests_end_on_an_end_token_a_stop_token_their_length_or_the_context():
    s = _scheduler(rows=4, blocks=64, max_seq=12, eos=(TOKEN,))
    eos = Request([1, 2], max_new_tokens=5)
    _submit(s, eos)
    _Loop(s).run()
    assert eos.token_ids == [TOKEN] and eos.finish_reason == FinishReason.STOP
    s = _scheduler(rows=4, blocks=64, max_seq=12)
    stop, length, context = (Request([1, 2], max_new_tokens=5, stop_ids=(TOKEN,)), Request([1, 2], max_new_tokens=3),
                             Request([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=20))
    seen = []
    length.on_token = lambda r, t: seen.append((t, r.finish_reason))
    _submit(s, stop, length, context)
    _Loop(s).run()
    assert (stop.token_ids, stop.finish_reason) == ([TOKEN], FinishReason.STOP)
    assert seen == [(TOKEN, None), (TOKEN, None), (TOKEN, FinishReason.LENGTH)]     # the reason set before on_token
    assert len(context.token_ids) == 12 - 8 and context.finish_reason == FinishReason.LENGTH
    assert all(r.finished_at >= r.first_token_at >= r.created for r in (stop, length, context))


def test_ignore_eos_generates_past_the_end_token_to_its_length_but_a_stop_token_still_ends_it():
    s = _scheduler(rows=4, blocks=64, max_seq=12, eos=(TOKEN,))
    past = Request([1, 2], max_new_tokens=5, ignore_eos=True)
    stopped = Request([1, 2], max_new_tokens=5, ignore_eos=True, stop_ids=(TOKEN,))
    _submit(s, past, stopped)
    _Loop(s).run()
    assert (past.token_ids, past.finish_reason) == ([TOKEN] * 5, FinishReason.LENGTH)
    assert (stopped.token_ids, stopped.finish_reason) == ([TOKEN], FinishReason.STOP)


def test_take_all_empties_the_queue_and_names_the_running_requests():
    s = _scheduler(rows=1)
    a, b = Request([1, 2]), Request([3, 4])
    _submit(s, a, b)
    s.schedule(0)
    assert s.take_all() == [b, a] and not s.waiting
