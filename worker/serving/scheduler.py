"""Which requests run next, and on which cache blocks: the engine's decisions, in plain Python
(no torch, no ranks), so they are tested alone.

Rows (at most max_batch requests at once) are split into one micro-batch per pipeline stage
(row % micro_batches). Each micro-batch has at most one step in flight; while stage 1 works on
micro-batch 0, stage 0 already runs micro-batch 1, so with as many micro-batches as stages every
stage stays busy.

A step spends a budget of tokens (`max_step_tokens`), as vLLM's scheduler does: first one decode
token for every row of the micro-batch that has its prompt in the cache (all of them, whatever the
budget: a running stream never waits), then the next chunk (at most `prefill_chunk` tokens) of
each row still prefilling, oldest admission first, while the budget lasts. All of it runs as ONE
forward in which each row has its own number of query tokens, its own positions and its own block
table (runner.py, cache_view.ragged_view), so prompts are prefilled together and alongside the
running decodes, and a long prompt delays the streams by one chunk per step, not by its prefill.

Each row also says how many of its last positions return logits (`Step.logits`): 0 for a chunk
short of its prompt's end, 1 for a decode or a prompt's last chunk, and 1 + k for a decode row
that feeds k draft tokens after its next one (`SequenceState.draft`: the speculator's proposal,
asked for as the step is built, or set by a caller before `schedule`); speculative.py verifies them
with the logits of each position and hands `append_tokens` the tokens it keeps for that row.

The cache is a pool of blocks (kv_blocks.py): a request is admitted when the blocks for its prompt
are free (less the blocks of a prefix another request left in the cache, which it shares), takes a
block every block_size tokens as it decodes, and gives them back when it ends. When a decode finds
no block, the request admitted last among those not in flight (itself, if it is that one) is
preempted: its blocks are
released (registered first, so that its resumption finds most of them still cached) and it goes
back to the front of the queue, to be prefilled again, prompt and tokens so far, when blocks free up.

Admission is bounded: at most `max_waiting` sequences wait for a row (None: no bound, for a caller
that submits its own fixed list). A submission that would take the queue past it is refused whole
with QueueFull, before anything of it is queued; requests cancelled while waiting (a client that
went away) leave the queue at the engine's next step, wherever they stand in it, and never count.

A step's life: `schedule` decides it (and marks its micro-batch in flight), the runner launches it
and collects its logits, `complete` records what it fed, and when it ends a request's prompt or
decodes, `append_tokens` hands the sampled tokens to the requests and ends those that are done.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.kv_blocks import BlockPool, blocks_for
from shardwise.worker.serving.request import FinishReason, Request
from shardwise.worker.serving.retry_after import FinishRate
from shardwise.worker.serving.defaults import MAX_STEP_TOKENS, PREFILL_CHUNK


@dataclass
class EngineStats:
    """Counts since the engine started, kept by the scheduler: each is of its decisions or of the
    steps it completes."""
    prefill_tokens: int = 0      # prompt tokens (and a resumption's tokens so far) fed
    decode_tokens: int = 0       # tokens fed one per row by decode steps
    steps: int = 0               # steps collected
    reused_tokens: int = 0       # prompt tokens found in the cache on admission, resumptions included
    preempted: int = 0           # requests preempted when the cache ran out of blocks
    rejected: int = 0            # submissions refused because the waiting queue was full


class QueueFull(WorkerError):
    """A submission refused because the waiting queue holds `max_waiting` sequences already: the
    caller may try again in `retry_after` seconds (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class SequenceState:
    """What the scheduler keeps about one request from its submission to its end."""
    req: Request
    row: int = -1                                        # -1: waiting (not admitted, or preempted)
    blocks: list[int] = field(default_factory=list)      # its block table
    fed: int = 0                                         # tokens whose keys/values are cached
    admitted: int = 0                                    # admission order (the last is preempted first)
    preemptions: int = 0
    # Tokens proposed to follow the next one (speculative decoding): the next decode step feeds
    # them in the same row and returns the logits of each position; cleared when scheduled.
    draft: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Step:
    """One step the scheduler decided: a micro-batch's rows, the tokens each row feeds (a decode
    token, a prompt chunk, or a decode token and its draft) from position `starts[i]`, each row's
    block table up to its last position, and how many of each row's last positions give logits."""
    micro_batch: int
    seqs: list[SequenceState]
    tokens: list[list[int]]      # [rows][that row's tokens]: a ragged batch
    starts: list[int]            # each row's first position
    tables: list[list[int]]      # [rows][blocks], padded with block 0 to the longest
    logits: list[int]            # per row: its last positions whose logits come back (0, 1, 1 + draft)
    decodes: int = 0             # the first `decodes` rows feed a generated token (the rest: prompts)

    @property
    def requests(self) -> list[Request]:
        return [s.req for s in self.seqs]

    @property
    def counts(self) -> list[int]:
        """Tokens each row feeds."""
        return [len(t) for t in self.tokens]

    @property
    def ready(self) -> list[int]:
        """The rows that give tokens (their logits come back), in order."""
        return [i for i, n in enumerate(self.logits) if n]

    def next_logits(self) -> list[int]:
        """For each ready row, the index among the step's logits of those that give its next
        token with no draft kept: a decode row's first position (after the token it feeds),
        a prompt row's last."""
        out, at = [], 0
        for i, n in enumerate(self.logits):
            if n:
                out.append(at if i < self.decodes else at + n - 1)
            at += n
        return out


class Scheduler:
    """Rows, the waiting queue and every request's blocks; `lock` guards the queue, which request
    threads append to (submit) while the engine thread takes from it."""

    def __init__(self, pool: BlockPool, max_batch: int, max_seq: int, micro_batches: int = 1,
                 prefill_chunk: int = PREFILL_CHUNK, eos_ids: tuple[int, ...] = (),
                 stats: EngineStats | None = None, on_finish: Callable[[Request], None] | None = None,
                 max_waiting: int | None = None, max_step_tokens: int = MAX_STEP_TOKENS, speculator=None):
        self.pool, self.block_size = pool, pool.block_size
        # speculative.Speculator (None: none): proposes each decoding row's draft as a step is built
        self.speculator = speculator
        self.max_batch, self.max_seq = max_batch, max_seq
        self.micro_batches, self.prefill_chunk = micro_batches, max(1, prefill_chunk)
        self.eos_ids = tuple(eos_ids)
        self.stats = stats if stats is not None else EngineStats()
        self.rows: list[SequenceState | None] = [None] * max_batch
        self.waiting: deque[SequenceState] = deque()
        self.busy = [False] * micro_batches                # a step of the micro-batch is in flight
        # Tokens per step, every decode included: at least one more than a micro-batch's rows, so
        # that a prompt admitted beside rows that all decode still advances (vLLM refuses less).
        self.max_step_tokens = max(max_step_tokens, -(-max_batch // micro_batches) + 1)
        self.lock = threading.Condition()
        self.on_finish = on_finish                         # told of every request that ends
        self._admissions = itertools.count(1)
        self.max_waiting = max_waiting                     # sequences queued at most (None: no bound)
        self.finishes = FinishRate()                       # how fast places free: a 429's Retry-After

    # ---- requests ----------------------------------------------------------------------------
    def check(self, req: Request, sequences: int = 1) -> None:
        """Raises WorkerError when `req` (one of `sequences` submitted together) can never run
        here, QueueFull when the queue has no room for them now."""
        if not req.prompt_ids:
            raise WorkerError("prompt is empty")
        if len(req.prompt_ids) >= self.max_seq:
            raise WorkerError(f"prompt is {len(req.prompt_ids)} tokens; the context holds {self.max_seq} "
                              f"(prompt plus at least one generated token)")
        if req.max_new_tokens < 1:
            raise WorkerError("max_tokens must be at least 1")
        need = blocks_for(len(req.prompt_ids) + 1, self.block_size)
        if need > self.pool.num_blocks:
            raise WorkerError(f"prompt is {len(req.prompt_ids)} tokens; the KV cache holds "
                              f"{self.pool.num_blocks * self.block_size} (--kv-cache-tokens)")
        if self.max_waiting is not None and sequences > self.max_waiting:
            raise WorkerError(f"n is {sequences}; this server queues at most {self.max_waiting} choices "
                              f"at once (--max-waiting)")
        with self.lock:
            self._room_for(sequences)

    def add(self, reqs: list[Request]) -> None:
        """Queue checked requests (any thread), all or none: QueueFull when the queue has no room
        for every one of them."""
        with self.lock:
            self._room_for(len(reqs))
            self.waiting.extend(SequenceState(r) for r in reqs)
            self.lock.notify_all()

    def _room_for(self, sequences: int) -> None:
        """QueueFull (counted) unless `sequences` more fit in the queue; under `lock`."""
        if self.max_waiting is None:
            return
        queued = sum(not s.req.cancelled for s in self.waiting)      # at most max_waiting + preempted
        if queued + sequences > self.max_waiting:
            self.stats.rejected += 1
            wait = self.finishes.retry_after(queued + sequences - self.max_waiting, time.perf_counter())
            raise QueueFull(f"the server is busy: {queued} choices are waiting (at most {self.max_waiting}, "
                            f"--max-waiting); retry in {wait} s", retry_after=wait)

    def wait_for_work(self, timeout: float) -> None:
        """Block until a request is queued or `timeout` seconds pass (the idle engine thread)."""
        with self.lock:
            if not self.waiting:
                self.lock.wait(timeout)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.rows)

    def take_all(self) -> list[Request]:
        """Every queued and running request, the queue emptied (the engine fails them)."""
        with self.lock:
            reqs = [s.req for s in self.waiting] + [s.req for s in self.rows if s is not None]
            self.waiting.clear()
        return reqs

    def finish(self, seq: SequenceState, reason: FinishReason | None = None) -> None:
        """End a request: its row and blocks given back, then `done` set. A request ended with a
        `reason` of its own (cancelled, out of cache) gave no token that carried its end, so its
        `on_token` hears of it as token -1: a reader of the tokens never waits for one more."""
        req = seq.req
        if reason is not None:
            req.finish_reason = reason
        req.finished_at = time.perf_counter()
        with self.lock:
            self.finishes.record(req.finished_at)
        if seq.row >= 0:
            self._release(seq)
        if reason is not None and req.on_token is not None:
            req.on_token(req, -1)
        req.done.set()
        if self.on_finish is not None:
            self.on_finish(req)

    # ---- the cache ---------------------------------------------------------------------------
    def _admit(self, mb: int) -> None:
        """Give free rows of micro-batch `mb` to waiting requests, first come first served, while
        the cache has the blocks for their prompts."""
        self._drop_cancelled()
        while True:
            with self.lock:
                if not self.waiting:
                    return
                seq = self.waiting[0]
                if seq.req.cancelled:
                    self.waiting.popleft()
                    self.finish(seq, FinishReason.STOP)
                    continue
                row = self._free_row(mb)
                if row < 0:
                    return
                tokens = seq.req.sequence()
                shared = self.pool.match(tokens)
                need = blocks_for(len(tokens), self.block_size) - len(shared)
                if need > self.pool.available or self._prefilling_same(tokens, len(shared)):
                    self.pool.release(shared)
                    return
                self.waiting.popleft()
            seq.row, seq.blocks, seq.admitted = row, shared, next(self._admissions)
            seq.fed = len(shared) * self.block_size
            if not seq.preemptions:         # what the prompt found cached, not a resumption's
                seq.req.reused_tokens = seq.fed
            self.stats.reused_tokens += seq.fed
            self.rows[row] = seq
            self._grow(seq, len(tokens))                  # fits: checked above

    def _drop_cancelled(self) -> None:
        """End the waiting requests whose caller cancelled them, wherever they are in the queue:
        one that went away behind a long queue neither waits its turn nor holds a place in it."""
        with self.lock:
            if not any(s.req.cancelled for s in self.waiting):
                return
            gone = [s for s in self.waiting if s.req.cancelled]
            kept = [s for s in self.waiting if not s.req.cancelled]
            self.waiting.clear()
            self.waiting.extend(kept)
        for seq in gone:
            self.finish(seq, FinishReason.STOP)

    def _prefilling_same(self, tokens: list[int], cached_blocks: int) -> bool:
        """Whether a running request is prefilling the block of `tokens` that follows its cached
        ones: then `tokens` waits for that prefill to register the blocks it shares, rather than
        computing them a second time (requests with one system prompt often arrive together)."""
        bs = self.block_size
        start, end = cached_blocks * bs, (cached_blocks + 1) * bs
        if end >= len(tokens):
            return False
        block = tokens[start:end]
        return any(s.req.length - s.fed > 1 and s.fed < end <= s.req.length
                   and s.req.sequence()[start:end] == block for s in self.rows if s is not None)

    def _grow(self, seq: SequenceState, tokens: int) -> bool:
        """Blocks for `seq`'s first `tokens` positions, preempting requests admitted after it if
        none is free. False when none can be had now; `seq` itself is preempted when it is the
        one admitted last (unless it holds every block in use: it cannot grow at all)."""
        while len(seq.blocks) < blocks_for(tokens, self.block_size):
            block = self.pool.take(seq.row, len(seq.blocks))
            if block is None:
                victim = self._victim(seq)
                if victim is None:
                    return False
                if victim is seq:
                    if self.pool.used > len(seq.blocks):
                        self._preempt(seq)
                    return False
                self._preempt(victim)
                continue
            seq.blocks.append(block)
        return True

    def _victim(self, seq: SequenceState) -> SequenceState | None:
        """The request admitted last among those holding blocks with no step in flight, `seq`
        included (as vLLM does: a later request never takes an earlier one's blocks)."""
        idle = [s for s in self.rows if s is not None and (s.blocks or s is seq)
                and not self.busy[s.row % self.micro_batches]]
        return max(idle, key=lambda s: s.admitted, default=None)

    def _preempt(self, seq: SequenceState) -> None:
        self._release(seq)
        seq.fed, seq.preemptions = 0, seq.preemptions + 1
        self.stats.preempted += 1
        with self.lock:
            self.waiting.appendleft(seq)

    def _release(self, seq: SequenceState) -> None:
        """Give back `seq`'s row and blocks, its full blocks registered for reuse."""
        self.pool.register(seq.req.sequence()[:seq.fed], seq.blocks)
        self.pool.release(seq.blocks)
        seq.blocks = []
        self.rows[seq.row] = None
        seq.row = -1

    # ---- steps -------------------------------------------------------------------------------
    def _free_row(self, mb: int) -> int:
        for r in range(mb, self.max_batch, self.micro_batches):
            if self.rows[r] is None:
                return r
        return -1

    def schedule(self, mb: int) -> Step | None:
        """The next step of idle micro-batch `mb` (marked in flight), or None when it has no work:
        one token (and its draft) for every row that has its prompt cached, then prompt chunks
        of the prefilling rows, oldest first, up to the step's token budget."""
        self._admit(mb)
        live = []
        for seq in self.rows[mb::self.micro_batches]:
            if seq is None:
                continue
            if seq.req.cancelled:         # a client that went away: end it now, free its blocks
                self.finish(seq, FinishReason.STOP)
            else:
                live.append(seq)
        decoding = self._room_to_decode([s for s in live if s.req.length - s.fed == 1])
        budget = self.max_step_tokens - len(decoding)
        rows: list[tuple[SequenceState, list[int], int]] = []
        for s in decoding:
            if self.speculator is not None:
                s.draft = self.speculator.proposal(s)
            draft = self._draft(s, budget)
            budget -= len(draft)
            rows.append((s, [s.req.token_at(s.fed)] + draft, 1 + len(draft)))
        # Rows a decode's growth preempted are gone from `rows` (row -1); prompts need no new
        # blocks (admission took them all).
        prefilling = sorted((s for s in live if s.row >= 0 and s.req.length - s.fed > 1), key=lambda s: s.admitted)
        for s in prefilling:
            n = min(s.req.length - s.fed, self.prefill_chunk, budget)
            if n < 1:
                break
            budget -= n
            rows.append((s, s.req.sequence()[s.fed:s.fed + n], int(s.fed + n >= s.req.length)))
        if not rows:
            return None
        seqs = [r[0] for r in rows]
        tokens = [r[1] for r in rows]
        self.busy[mb] = True
        return Step(mb, seqs, tokens, [s.fed for s in seqs],
                    self._tables(seqs, max(s.fed + len(t) for s, t in zip(seqs, tokens))),
                    [r[2] for r in rows], len(decoding))

    def _draft(self, seq: SequenceState, budget: int) -> list[int]:
        """The part of `seq`'s draft that this step feeds: what the budget, the context and the
        blocks (taken without preempting anyone) allow. The draft is cleared: a caller proposes
        anew before each step."""
        draft, seq.draft = seq.draft, []
        room = self.max_seq - seq.fed - 1
        draft = draft[:max(0, min(budget, room))]
        while draft and not self._grow_free(seq, seq.fed + 1 + len(draft)):
            draft = draft[:-1]
        return draft

    def _grow_free(self, seq: SequenceState, tokens: int) -> bool:
        """Blocks for `seq`'s first `tokens` positions from those free or cached, preempting no one."""
        need = blocks_for(tokens, self.block_size) - len(seq.blocks)
        if need > self.pool.available:
            return False
        for _ in range(need):
            seq.blocks.append(self.pool.take(seq.row, len(seq.blocks)))
        return True

    def _room_to_decode(self, decoding: list[SequenceState]) -> list[SequenceState]:
        """The decoding rows that have (or could take) a block for their next position; one that
        alone holds the whole cache and needs more ends (length)."""
        for s in decoding:
            if s.row >= 0 and not self._grow(s, s.fed + 1) and s.row >= 0 and self.pool.used == len(s.blocks):
                self.finish(s, FinishReason.LENGTH)
        return [s for s in decoding if s.row >= 0 and len(s.blocks) * self.block_size > s.fed]

    def _tables(self, seqs: list[SequenceState], positions: int) -> list[list[int]]:
        """Each row's block table for its first `positions` positions, padded with block 0."""
        nb = blocks_for(positions, self.block_size)
        pad = [0] * nb
        return [(s.blocks + pad)[:nb] for s in seqs]

    def complete(self, step: Step) -> bool:
        """A launched step came back: its tokens are cached and its micro-batch is free. Returns
        whether any row gives a token (a decode, or the end of a prompt). A decode row's draft
        tokens are cached too, but count as fed only once append_tokens keeps them."""
        self.busy[step.micro_batch] = False
        stats = self.stats
        stats.steps += 1
        for i, (seq, tokens) in enumerate(zip(step.seqs, step.tokens)):
            if i < step.decodes:
                stats.decode_tokens += 1
                seq.fed += 1
            else:
                stats.prefill_tokens += len(tokens)
                seq.fed += len(tokens)
                # a prompt chunk: its full blocks are shareable at once
                self.pool.register(seq.req.sequence()[:seq.fed], seq.blocks)
        return bool(step.ready)

    def append_tokens(self, step: Step, tokens: list) -> None:
        """The sampled tokens of the step's ready rows (Step.ready, in order) to their requests,
        which end on an end-of-sequence or stop token, a cancel, max_new_tokens or the context's
        end. A row that fed a draft may be given a list instead: the draft tokens it accepts (a
        prefix of its draft, whose keys and values the step cached) and then the token that
        follows them; the row's request takes them one by one and may end part-way."""
        now = time.perf_counter()
        for i, given in zip(step.ready, tokens):
            seq = step.seqs[i]
            kept = given if isinstance(given, list) else [given]
            accepted = step.tokens[i][1:1 + len(kept) - 1] if i < step.decodes else []
            if kept[:-1] != accepted:
                raise ValueError("the tokens kept of a draft must be a prefix of it")
            for j, token in enumerate(kept):
                if j:
                    seq.fed += 1                 # the accepted draft token before this one is cached
                if self._append(seq, token, now):
                    break

    def _append(self, seq: SequenceState, token: int, now: float) -> bool:
        """One token to `seq`'s request; True when that ends it."""
        req = seq.req
        req.token_ids.append(token)
        if req.first_token_at is None:
            req.first_token_at = now
        if (token in self.eos_ids and not req.ignore_eos) or token in req.stop_ids or req.cancelled:
            req.finish_reason = FinishReason.STOP
        elif len(req.token_ids) >= req.max_new_tokens or seq.fed + 1 >= self.max_seq:
            req.finish_reason = FinishReason.LENGTH
        if req.on_token is not None:
            req.on_token(req, token)
        if req.finish_reason:
            self.finish(seq)
            return True
        return False
