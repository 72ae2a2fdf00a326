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
               max_waiting: int | None = None) -> Scheduler:
    pool = BlockPool(blocks, block_size, lanes=rows, prefix_cache=prefix_cache)
    return Scheduler(pool, rows, max_seq, micro_batches, chunk, eos, max_waiting=max_waiting)


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
            self.s.append_tokens(step, [TOKEN] * len(step.seqs))
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
    # the 12-token prompt takes 3 of the 4 blocks; the next needs 1 and gets it, in the next row
    assert first.requests == [big] and s.running == 2 and not s.waiting
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


def test_preemption_takes_the_request_admitted_last_among_those_with_no_step_in_flight():
    # Two micro-batches of three rows; six one-block prompts fill the six blocks.
    s = _scheduler(rows=6, blocks=6, block_size=2, micro_batches=2)
    a, b, c, d, e, f = reqs = [Request([10 + i, 20 + i], max_new_tokens=4) for i in range(6)]
    _submit(s, *reqs)
    first, second = s.schedule(0), s.schedule(1)          # a, b, c in micro-batch 0; d, e, f in 1
    assert first.requests == [a] and second.requests == [d] and s.running == 6
    assert s.complete(first)
    s.append_tokens(first, [TOKEN])
    # a's next position needs a block; d, e and f were admitted later, but micro-batch 1 is in flight
    step = s.schedule(0)
    assert step.requests == [a] and not step.prefill
    assert s.stats.preempted == 1 and [q.req for q in s.waiting] == [c]
    assert c not in [q.req for q in s.rows if q is not None] and b in [q.req for q in s.rows if q is not None]


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


def test_prompt_chunks_take_turns_with_the_running_decodes():
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
    assert [st.prefill for st in loop.launched] == [False, True] * 5     # 20 tokens: 5 chunks of 4
    assert [st.fed for st in loop.launched if st.prefill] == [4] * 5


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


def test_take_all_empties_the_queue_and_names_the_running_requests():
    s = _scheduler(rows=1)
    a, b = Request([1, 2]), Request([3, 4])
    _submit(s, a, b)
    s.schedule(0)
    assert s.take_all() == [b, a] and not s.waiting
