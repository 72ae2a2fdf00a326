"""Generation on rank 0: prefill + decode over the pipeline, with concurrent requests batched.

Cache slots are split into one micro-batch per pipeline stage (slot % micro_batches). Each
micro-batch has at most one step in flight; while stage 1 works on micro-batch 0, stage 0 already
runs micro-batch 1, so with as many micro-batches as stages every stage stays busy. Within a
micro-batch, all running requests decode together (one token each per step); a new request is
admitted into a free slot with its own prefill step.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import WorkerError
from .pipeline import OP_SETUP, OP_STEP

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
    cancelled: bool = False                                   # set by the caller: stop after the next token
    _slot: int = -1
    _generator: torch.Generator | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def cached(self) -> int:
        """Tokens whose keys/values are in the cache: the prompt and all but the newest token."""
        return len(self.prompt_ids) + max(0, len(self.token_ids) - 1)


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
    def __init__(self, stage, max_batch: int, max_seq: int, eos_ids: list[int], micro_batches: int = 0):
        self.stage = stage
        self.max_batch, self.max_seq = max_batch, max_seq
        self.eos_ids = tuple(eos_ids)
        pipeline = stage.info.pipeline
        self.micro_batches = max(1, min(micro_batches or pipeline, max_batch))
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.busy = [False] * self.micro_batches
        self.inflight: deque = deque()          # (micro-batch, requests) in launch order
        self.lock = threading.Condition()
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
        stage.launch(OP_SETUP, batch=max_batch, seq=max_seq)

    # ---- requests ----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        if not req.prompt_ids:
            raise WorkerError("prompt is empty")
        if len(req.prompt_ids) >= self.max_seq:
            raise WorkerError(f"prompt is {len(req.prompt_ids)} tokens; the context holds {self.max_seq} "
                              f"(prompt plus at least one generated token)")
        if req.max_new_tokens < 1:
            raise WorkerError("max_tokens must be at least 1")

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

    # ---- scheduling --------------------------------------------------------------------------
    def _free_slot(self, mb: int) -> int:
        for s in range(mb, self.max_batch, self.micro_batches):
            if self.slots[s] is None:
                return s
        return -1

    def _launch(self, mb: int) -> bool:
        with self.lock:
            slot = self._free_slot(mb) if self.waiting else -1
            req = self.waiting.popleft() if slot >= 0 else None
        if req is not None:                     # admit: prefill the whole prompt in one step
            req._slot = slot
            self.slots[slot] = req
            n = len(req.prompt_ids)
            tokens = torch.tensor([req.prompt_ids])
            self.stage.launch(OP_STEP, tokens, torch.arange(n)[None], torch.tensor([slot]))
            self.inflight.append((mb, [req], True))
            return True
        running = [r for r in self.slots[mb::self.micro_batches] if r is not None]
        if not running:
            return False
        tokens = torch.tensor([[r.token_ids[-1]] for r in running])
        positions = torch.tensor([[r.cached] for r in running])
        slots = torch.tensor([r._slot for r in running])
        self.stage.launch(OP_STEP, tokens, positions, slots)
        self.inflight.append((mb, running, False))
        return True

    def step(self) -> bool:
        """Launch every idle micro-batch that has work, then finish the oldest step in flight.
        Returns False when there is nothing to do."""
        for mb in range(self.micro_batches):
            if not self.busy[mb] and self._launch(mb):
                self.busy[mb] = True
        if not self.inflight:
            return False
        mb, reqs, prefill = self.inflight.popleft()
        logits = self.stage.collect()
        self.busy[mb] = False
        self.stats["steps"] += 1
        if prefill:
            self.stats["prefill_tokens"] += len(reqs[0].prompt_ids)
        else:
            self.stats["decode_tokens"] += len(reqs)
        tokens = choose(logits, reqs)
        logprobs_of(logits, reqs, tokens)
        now = time.perf_counter()
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
            if req.first_token_at is None:
                req.first_token_at = now
            if token in self.eos_ids or token in req.stop_ids or req.cancelled:
                req.finish_reason = "stop"
            elif len(req.token_ids) >= req.max_new_tokens or req.cached + 1 >= self.max_seq:
                req.finish_reason = "length"
            if req.on_token is not None:
                req.on_token(req, token)
            if req.finish_reason:
                self._finish(req)
        return True

    def _finish(self, req: Request) -> None:
        req.finished_at = time.perf_counter()
        self.slots[req._slot] = None
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
