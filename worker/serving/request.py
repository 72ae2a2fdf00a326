"""One generation request: what the caller asks for and what it gets back, nothing the engine keeps
for itself (its row, blocks and progress are the scheduler's, scheduler.py SequenceState).

Threads: the caller builds the request, submits it, may cancel it, and waits on `done`; the engine
thread writes the results, calls `on_token` after each token and sets `done` last.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

_ids = itertools.count(1)


class FinishReason(str, Enum):
    """Why a request ended (OpenAI's finish_reason values): equal to those strings, and printed,
    formatted and written to JSON as them."""
    STOP = "stop"          # an end-of-sequence or stop token, or cancelled
    LENGTH = "length"      # max_new_tokens, the context, or the whole cache reached
    ERROR = "error"        # the engine failed or shut down before the end (`error` says why)

    def __str__(self) -> str:
        return self.value


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False             # the model's end-of-sequence tokens do not end it (stop_ids still do)
    logprobs: int | None = None          # None: none; k >= 0: each token's log-probability and the top k
    on_token: Callable[["Request", int], None] | None = None   # called on the engine thread
    id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)        # generated tokens only
    # with logprobs set: per generated token, (its log-probability, [(token id, log-probability)] of
    # the top `logprobs` tokens, most likely first)
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False              # set by the caller: ends at its next step, its blocks freed
    reused_tokens: int = 0               # prompt tokens found in the cache instead of prefilled (on admission)

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
