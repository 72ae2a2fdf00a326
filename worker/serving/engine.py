"""Generation on rank 0: chunked prefill + decode over the pipeline, with concurrent requests
batched over a paged KV cache.

Rows (at most max_batch requests at once) are split into one micro-batch per pipeline stage
(row % micro_batches). Each micro-batch has at most one step in flight; while stage 1 works on
micro-batch 0, stage 0 already runs micro-batch 1, so with as many micro-batches as stages every
stage stays busy. Within a micro-batch, a step is either one decode token for every request that
has its prompt in the cache, or the next chunk of one request's prompt; when both wait they take
turns, so a long prompt delays the running streams by one chunk at a time, not by its whole prefill.

The cache is a pool of blocks (kv_blocks.py): a request is admitted when the blocks for its prompt
are free (less the blocks of a prefix another request left in the cache, which it shares), takes a
block every block_size tokens as it decodes, and gives them back when it ends. When a decode finds
no block, the request admitted last among those not in flight is preempted: its blocks are
released (registered first, so that its resumption finds most of them still cached) and it goes
back to the front of the queue, to be prefilled again, prompt and tokens so far, when blocks free up.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.kv_blocks import BlockPool, blocks_for
from shardwise.worker.serving.pipeline import OP_SETUP, OP_STEP

DEFAULT_BLOCK_SIZE = 16          # tokens per KV-cache block (vLLM's default)
DEFAULT_PREFILL_CHUNK = 512      # prompt tokens per prefill step

_ids = itertools.count(1)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None          # None: none; k >= 0: each token's log-probability and the top k
    on_token: Callable[["Request", int], None] | None = None   # called on the engine thread
    id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)        # generated tokens only
    # with logprobs set: per generated token, (its log-probability, [(token id, log-probability)] of
    # the top `logprobs` tokens, most likely first)
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False              # set by the caller: ends at its next step, its blocks freed
    reused_tokens: int = 0               # prompt tokens found in the cache instead of prefilled (on admission)
    preemptions: int = 0
    _slot: int = -1
    _blocks: list[int] = field(default_factory=list)          # its block table
    _fed: int = 0                                             # tokens whose keys/values are cached
    _admitted: int = 0
    _generator: torch.Generator | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def length(self) -> int:
        """The prompt and the tokens generated so far."""
        return len(self.prompt_ids) + len(self.token_ids)

    def sequence(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.token_ids[i - n]


def sample(logits: torch.Tensor, req: Request) -> int:
    if req.temperature <= 0:
        # numpy's argmax: ~4 us over a 49k vocabulary where torch.argmax takes ~85 us (the same
        # first index on ties and NaN). Logits arrive as float32 on the CPU (Stage.collect).
        return int(logits.float().numpy().argmax())
    logits = logits.float() / req.temperature
    if req.top_k > 0:
        kth = torch.topk(logits, min(req.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if req.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < req.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    if req._generator is None:
        req._generator = torch.Generator()
        req._generator.manual_seed(req.seed if req.seed is not None else torch.seed())
    return int(torch.multinomial(probs, 1, generator=req._generator))


def choose(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """Each row's next token. Greedy rows on a GPU are picked there: a row's id comes back
    instead of its whole vocabulary (0.5 MB of float32 for Llama-3's 128k tokens)."""
    if logits.is_cuda and all(r.temperature <= 0 for r in reqs):
        return logits.argmax(-1).tolist()
    logits = logits.cpu()
    return [sample(logits[row], req) for row, req in enumerate(reqs)]


def logprobs_of(logits: torch.Tensor, reqs: list[Request], tokens: list[int]) -> None:
    """Appends to each request that asked (logprobs is not None) the log-probability of its chosen
    token and its top-k alternatives, of the distribution the token was drawn from: log_softmax of
    the logits divided by the temperature (of the raw logits for greedy rows; top-p/top-k
    truncation is not applied). Only the rows that ask are computed, on the logits' own device;
    rows that do not ask cost one attribute check."""
    rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    if not rows:
        return
    asking = [reqs[i] for i in rows]
    x = (logits if len(rows) == len(reqs) else logits[torch.tensor(rows, device=logits.device)]).float()
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in asking],
                         dtype=torch.float32, device=x.device)
    lsm = torch.log_softmax(x / temps[:, None], dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=x.device)
    picked = lsm.gather(1, chosen[:, None])[:, 0].tolist()
    k = min(max(r.logprobs for r in asking), lsm.shape[-1])
    if k > 0:
        top = torch.topk(lsm, k, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    for j, r in enumerate(asking):
        alts = list(zip(ids[j][:r.logprobs], values[j][:r.logprobs])) if k > 0 and r.logprobs else []
        r.token_logprobs.append((picked[j], alts))


class Engine:
    """`kv_tokens`: the cache's size in tokens (0: max_batch whole contexts, the memory of one
    fixed row per request); `block_size`: tokens per block (a block of max_seq or more keeps
    one fixed row per request, as CUDA graphs need); `prefill_chunk`: prompt tokens per step."""

    def __init__(self, stage, max_batch: int, max_seq: int, eos_ids: list[int], micro_batches: int = 0,
                 kv_tokens: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefix_cache: bool = True):
        self.stage = stage
        self.max_batch, self.max_seq = max_batch, max_seq
        self.eos_ids = tuple(eos_ids)
        pipeline = stage.info.pipeline
        self.micro_batches = max(1, min(micro_batches or pipeline, max_batch))
        self.prefill_chunk = max(1, prefill_chunk)
        if getattr(stage, "graphed", None) is not None or block_size >= max_seq:
            block_size, blocks = max_seq, max_batch      # fixed rows: one block of the whole context each
        else:
            blocks = blocks_for(kv_tokens or max_batch * max_seq, block_size)
        self.block_size = block_size
        self.pool = BlockPool(blocks, block_size, lanes=max_batch, prefix_cache=prefix_cache)
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.busy = [False] * self.micro_batches
        self.decoded_last = [True] * self.micro_batches    # which kind of step each ran last
        self.inflight: deque = deque()          # (micro-batch, requests, tokens fed per request)
        self.lock = threading.Condition()
        self._admissions = itertools.count(1)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "reused_tokens": 0, "preempted": 0}
        stage.launch(OP_SETUP, cache_blocks=blocks, seq=max_seq, block_size=block_size)

    @classmethod
    def for_rank(cls, ctx, eos_ids: list[int], micro_batches: int = 0, rows: int = 0) -> "Engine":
        """The engine of a loaded rank 0 (runtime.RankContext), sized by its RankSpec (`rows`:
        requests at once, if not its max_batch)."""
        spec = ctx.spec
        return cls(ctx.stage, rows or spec.max_batch, ctx.max_seq, eos_ids, micro_batches, kv_tokens=spec.kv_tokens,
                   block_size=spec.kv_block, prefill_chunk=spec.prefill_chunk)

    # ---- requests ----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
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

    def submit(self, req: Request) -> Request:
        self.check(req)
        with self.lock:
            self.waiting.append(req)
            self.lock.notify_all()
        return req

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run the given requests to completion (batched together) on the calling thread."""
        for r in requests:
            self.submit(r)
        while self.step():
            pass
        return requests

    # ---- the cache ---------------------------------------------------------------------------
    def _admit(self, mb: int) -> None:
        """Give free rows of micro-batch `mb` to waiting requests, first come first served, while
        the cache has the blocks for their prompts."""
        while True:
            with self.lock:
                if not self.waiting:
                    return
                req = self.waiting[0]
                if req.cancelled:
                    self.waiting.popleft()
                    req.finish_reason = "stop"
                    self._finish(req)
                    continue
                slot = self._free_slot(mb)
                if slot < 0:
                    return
                seq = req.sequence()
                shared = self.pool.match(seq)
                need = blocks_for(len(seq), self.block_size) - len(shared)
                if need > self.pool.available or self._prefilling_same(seq, len(shared)):
                    self.pool.release(shared)
                    return
                self.waiting.popleft()
            req._slot, req._blocks, req._admitted = slot, shared, next(self._admissions)
            req._fed = len(shared) * self.block_size
            if not req.preemptions:         # what the prompt found cached, not a resumption's
                req.reused_tokens = req._fed
            self.stats["reused_tokens"] += req._fed
            self.slots[slot] = req
            self._grow(req, len(seq))                     # fits: checked above

    def _prefilling_same(self, seq: list[int], cached_blocks: int) -> bool:
        """Whether a running request is prefilling the block of `seq` that follows its cached
        ones: then `seq` waits for that prefill to register the blocks it shares, rather than
        computing them a second time (requests with one system prompt often arrive together)."""
        bs = self.block_size
        start, end = cached_blocks * bs, (cached_blocks + 1) * bs
        if end >= len(seq):
            return False
        block = seq[start:end]
        return any(r.length - r._fed > 1 and r._fed < end <= r.length and r.sequence()[start:end] == block
                   for r in self.slots if r is not None)

    def _grow(self, req: Request, tokens: int) -> bool:
        """Blocks for `req`'s first `tokens` positions, preempting others if none is free. False
        when none can be had now."""
        while len(req._blocks) < blocks_for(tokens, self.block_size):
            block = self.pool.take(req._slot, len(req._blocks))
            if block is None:
                victim = self._victim(req)
                if victim is None:
                    return False
                self._preempt(victim)
                continue
            req._blocks.append(block)
        return True

    def _victim(self, req: Request) -> Request | None:
        """The request admitted last among those holding blocks with no step in flight."""
        idle = [r for r in self.slots if r is not None and r is not req and r._blocks
                and not self.busy[r._slot % self.micro_batches]]
        return max(idle, key=lambda r: r._admitted, default=None)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req._fed, req.preemptions = 0, req.preemptions + 1
        self.stats["preempted"] += 1
        with self.lock:
            self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        """Give back `req`'s row and blocks, its full blocks registered for reuse."""
        self.pool.register(req.sequence()[:req._fed], req._blocks)
        self.pool.release(req._blocks)
        req._blocks = []
        self.slots[req._slot] = None
        req._slot = -1

    # ---- scheduling --------------------------------------------------------------------------
    def _free_slot(self, mb: int) -> int:
        for s in range(mb, self.max_batch, self.micro_batches):
            if self.slots[s] is None:
                return s
        return -1

    def _launch(self, mb: int) -> bool:
        self._admit(mb)
        rows = []
        for r in self.slots[mb::self.micro_batches]:
            if r is None:
                continue
            if r.cancelled:               # a client that went away: end it now, free its blocks
                r.finish_reason = "stop"
                self._finish(r)
            else:
                rows.append(r)
        decoding = [r for r in rows if r.length - r._fed == 1]
        prefilling = [r for r in rows if r.length - r._fed > 1]
        if prefilling and (not decoding or self.decoded_last[mb]):
            req = min(prefilling, key=lambda r: r._admitted)
            n = min(req.length - req._fed, self.prefill_chunk)
            ids = req.sequence()[req._fed:req._fed + n]
            self._send(mb, [req], torch.tensor([ids]), torch.arange(req._fed, req._fed + n)[None], [n])
            self.decoded_last[mb] = False
            return True
        for r in decoding:
            if r._slot >= 0 and not self._grow(r, r._fed + 1) and self.pool.used == len(r._blocks):
                r.finish_reason = "length"      # alone, it has the whole cache and needs more
                self._finish(r)
        decoding = [r for r in decoding if r._slot >= 0 and len(r._blocks) * self.block_size > r._fed]
        if not decoding:
            return False
        tokens = torch.tensor([[r.token_at(r._fed)] for r in decoding])
        positions = torch.tensor([[r._fed] for r in decoding])
        self._send(mb, decoding, tokens, positions, [1] * len(decoding))
        self.decoded_last[mb] = True
        return True

    def _send(self, mb: int, reqs: list[Request], tokens, positions, fed: list[int]) -> None:
        """Launch one step of `reqs`, each row's block table up to the step's last position."""
        nb = blocks_for(int(positions[:, -1].max()) + 1, self.block_size)
        blocks = torch.tensor([(r._blocks + [0] * nb)[:nb] for r in reqs])
        self.stage.launch(OP_STEP, tokens, positions, blocks)
        self.inflight.append((mb, reqs, fed))

    def step(self) -> bool:
        """Launch every idle micro-batch that has work, then finish the oldest step in flight.
        Returns False when there is nothing to do."""
        for mb in range(self.micro_batches):
            if not self.busy[mb] and self._launch(mb):
                self.busy[mb] = True
        if not self.inflight:
            return False
        mb, reqs, fed = self.inflight.popleft()
        logits = self.stage.collect()
        self.busy[mb] = False
        self.stats["steps"] += 1
        if fed[0] > 1 or len(reqs[0].token_ids) == 0:
            self.stats["prefill_tokens"] += fed[0]
        else:
            self.stats["decode_tokens"] += len(reqs)
        for req, n in zip(reqs, fed):
            req._fed += n
        if fed[0] > 1:                  # a prefill chunk: its full blocks are shareable at once
            self.pool.register(reqs[0].sequence()[:reqs[0]._fed], reqs[0]._blocks)
        if reqs[0]._fed < reqs[0].length:        # short of the prompt's end: no token yet
            return True
        tokens = choose(logits, reqs)
        logprobs_of(logits, reqs, tokens)
        now = time.perf_counter()
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
            if token in self.eos_ids or token in req.stop_ids or req.cancelled:
                req.finish_reason = "stop"
            elif len(req.token_ids) >= req.max_new_tokens or req._fed + 1 >= self.max_seq:
                req.finish_reason = "length"
            if req.on_token is not None:
                req.on_token(req, token)
            if req.finish_reason:
                self._finish(req)
        return True

    def _finish(self, req: Request) -> None:
        req.finished_at = time.perf_counter()
        if req._slot >= 0:
            self._release(req)
        req.done.set()
    # ---- background loop for the server ------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                with self.lock:
                    if not self.waiting:
                        self.lock.wait(0.05)

    def fail_all(self, message: str) -> None:
        with self.lock:
            reqs = list(self.waiting) + [r for r in self.slots if r is not None]
            self.waiting.clear()
        for req in reqs:
            req.error, req.finish_reason = message, "error"
            if req.on_token is not None:
                req.on_token(req, -1)
            req.done.set()

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)
