"""Generation on rank 0: the loop that ties the engine's parts together, with concurrent requests
batched over a paged KV cache.

    scheduler.py  which requests run next: rows, micro-batches, a token budget per step shared
                  by every running decode and the prompt chunks of as many prefilling requests
                  as fit, admission, prefix reuse, growth and preemption over the block pool
    kv_blocks.py  the block pool: which block of the cache holds which tokens
    runner.py     a decided step on the pipeline's stages, and its logits back
    sampling.py   each row's next token (greedy or sampled), and log-probabilities
    request.py    what a caller asks for and gets back

Each `step` launches every idle micro-batch that has work, then collects the oldest step in flight
and hands its sampled tokens to its requests. One thread steps the engine; others only submit.
"""
from __future__ import annotations

import threading

from shardwise.worker.serving.kv_blocks import BlockPool, blocks_for
from shardwise.worker.serving.request import FinishReason, Request
from shardwise.worker.serving.runner import Runner
from shardwise.worker.serving.sampling import Sampler
from shardwise.worker.serving.defaults import KV_BLOCK_SIZE, MAX_STEP_TOKENS, PREFILL_CHUNK
from shardwise.worker.serving.scheduler import EngineStats, QueueFull, Scheduler
from shardwise.worker.serving.speculative import SpeculativeConfig, Speculator

__all__ = ["Engine", "EngineStats", "FinishReason", "QueueFull", "Request"]


class Engine:
    """`kv_tokens`: the cache's size in tokens (0: max_batch whole contexts, the memory of one
    fixed row per request); `block_size`: tokens per block (a block of max_seq or more keeps
    one fixed row per request); `prefill_chunk`: prompt tokens of one request per step;
    `max_step_tokens`: tokens per step, every running decode (and its drafts) and prompt chunks;
    `max_waiting`: sequences queued at most, beyond which a submission raises QueueFull (None: no
    bound, for a caller that submits a fixed list of its own); `speculative`: prompt-lookup drafts
    verified in decode steps (speculative.py; None: none)."""

    def __init__(self, stage, max_batch: int, max_seq: int, eos_ids: list[int], micro_batches: int = 0,
                 kv_tokens: int = 0, block_size: int = KV_BLOCK_SIZE,
                 prefill_chunk: int = PREFILL_CHUNK, prefix_cache: bool = True, max_waiting: int | None = None,
                 max_step_tokens: int = MAX_STEP_TOKENS, speculative: SpeculativeConfig | None = None):
        self.stage = stage
        self.max_batch, self.max_seq = max_batch, max_seq
        self.micro_batches = max(1, min(micro_batches or stage.info.pipeline, max_batch))
        if block_size >= max_seq:
            block_size, blocks = max_seq, max_batch      # fixed rows: one block of the whole context each
        else:
            blocks = blocks_for(kv_tokens or max_batch * max_seq, block_size)
        self.block_size = block_size
        self.pool = BlockPool(blocks, block_size, lanes=max_batch, prefix_cache=prefix_cache)
        self.stats = EngineStats()
        self.sampler = Sampler()
        self.speculator = Speculator(speculative) if speculative is not None else None
        self.scheduler = Scheduler(self.pool, max_batch, max_seq, self.micro_batches, prefill_chunk,
                                   tuple(eos_ids), self.stats, on_finish=self._forget, max_waiting=max_waiting,
                                   max_step_tokens=max_step_tokens, speculator=self.speculator)
        self.runner = Runner(stage, blocks, max_seq, block_size)

    @classmethod
    def for_rank(cls, ctx, eos_ids: list[int], micro_batches: int = 0, rows: int = 0,
                 max_waiting: int | None = None) -> "Engine":
        """The engine of a loaded rank 0 (runtime.RankContext), sized by its RankSpec (`rows`:
        requests at once, if not its max_batch)."""
        spec = ctx.spec
        return cls(ctx.stage, rows or spec.max_batch, ctx.max_seq, eos_ids, micro_batches, kv_tokens=spec.kv_tokens,
                   block_size=spec.kv_block, prefill_chunk=spec.prefill_chunk, max_waiting=max_waiting,
                   max_step_tokens=spec.max_step_tokens, speculative=spec.speculative)

    def _forget(self, req: Request) -> None:
        """`req` ended: what the sampler and the speculator kept for it goes."""
        self.sampler.forget(req)
        if self.speculator is not None:
            self.speculator.forget(req)

    # ---- requests ----------------------------------------------------------------------------
    def check(self, req: Request, sequences: int = 1) -> None:
        """Raises WorkerError (the message for the user) when `req`, one of `sequences` requests
        submitted together, can never run here; QueueFull when the queue has no room for them now."""
        self.scheduler.check(req, sequences)

    def submit(self, req: Request) -> Request:
        self.submit_all([req])
        return req

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue requests together (a request's choices): all of them, or none and QueueFull."""
        for r in reqs:
            self.scheduler.check(r, len(reqs))
        self.scheduler.add(reqs)

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run the given requests to completion (batched together) on the calling thread."""
        for r in requests:
            self.submit(r)
        while self.step():
            pass
        return requests

    @property
    def waiting(self):
        """The queued requests (admitted ones not counted), as a sized collection."""
        return self.scheduler.waiting

    @property
    def running(self) -> int:
        return self.scheduler.running

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Launch every idle micro-batch that has work, then finish the oldest step in flight.
        Returns False when there is nothing to do."""
        scheduler, runner = self.scheduler, self.runner
        busy = scheduler.busy
        for mb in range(scheduler.micro_batches):
            if not busy[mb]:
                step = scheduler.schedule(mb)
                if step is not None:
                    runner.launch(step)
        if not runner.inflight:
            return False
        step, logits = runner.collect()
        if not scheduler.complete(step):
            return True
        ready = step.ready
        if len(ready) == len(logits):            # one token's logits per ready row: no draft fed
            scheduler.append_tokens(step, self.sampler(logits, [step.seqs[i].req for i in ready]))
        elif self.speculator is not None:
            self.speculator.verify(step, logits, self.sampler, scheduler)
        else:                                    # drafts a caller set, which nothing here verifies
            scheduler.append_tokens(step, self.sampler(logits[step.next_logits()],
                                                       [step.seqs[i].req for i in ready]))
        return True

    def run_forever(self, stop: threading.Event) -> None:
        """The server's engine thread: step until `stop` is set, idle while nothing is queued."""
        while not stop.is_set():
            if not self.step():
                self.scheduler.wait_for_work(0.05)

    def fail_all(self, message: str) -> None:
        """End every queued and running request with `message` as its error."""
        for req in self.scheduler.take_all():
            req.error, req.finish_reason = message, FinishReason.ERROR
            if req.on_token is not None:
                req.on_token(req, -1)
            req.done.set()
