"""One choice's tokens, from the engine thread to text pieces on the request's thread.

The engine calls `Request.on_token` on the thread that owns every torch.distributed call, so the
callback (TokenFeed) only counts the token and queues it. The request's HTTP thread takes the
tokens off the queue and runs each choice's ChoiceStream: incremental detokenization, stop
strings, holding back incomplete UTF-8 characters, and the logprob entries each piece covers.
Every step costs what the new token adds, not what the whole text is: stop strings are looked for
in the text not given out yet, which is at most the longest stop string less one character plus
the new token's text (an occurrence found there is the first in the whole text, since the text
before it was searched at earlier tokens).
"""
from __future__ import annotations

import codecs
import queue
import time
from typing import Callable, Iterator, NamedTuple

from shardwise.worker.serving.request import FinishReason, Request
from shardwise.worker.serving.http.detokenize import REPLACEMENT, IncrementalDetokenizer, TokenText
from shardwise.worker.serving.http.metrics import Metrics


POLL_SECONDS = 0.25         # how often a request waiting for tokens looks whether its client is still there


class ClientGone(Exception):
    """The client closed its connection while its request was generating."""


class Entry(NamedTuple):
    """A token's logprob entry: the token, its log-probability, its top alternatives
    [(token, log-probability)], and its character offset in the choice's text."""
    token: int
    logprob: float
    top: list
    offset: int


class Piece(NamedTuple):
    """What one token gives a choice: the text it adds, the logprob entries of the tokens that
    text covers, and whether the choice has ended."""
    index: int
    text: str
    entries: list[Entry]
    finished: bool


class ChoiceStream:
    """One choice (one engine request): its text piece by piece, cut before the first stop string."""

    def __init__(self, index: int, req: Request, tokenizer, stop: list[str], token_text: TokenText | None = None):
        self.index, self.req, self.stop, self.token_text = index, req, stop, token_text
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        # a tail of the text that could still grow into a stop string is held back
        self.hold = max((len(s) - 1 for s in stop), default=0)
        self.unsent = ""             # stable text not given out yet (at most `hold` characters)
        self.pending = ""            # text after it that is not stable yet (an incomplete character)
        self.sent = 0                # characters given out
        self.finished = False
        self.finish_reason: str | None = None
        self.tokens = 0              # the choice's tokens, up to the one that completed a stop string
        # tokens whose text has all been given out, and nothing after it: the point from which
        # another replica can continue the choice exactly (return_token_ids)
        self.settled = 0
        # logprobs: each token's character offset in the completion, from the bytes it adds
        self.offsets: list[int] = []
        self.chars = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.given = 0               # tokens whose logprob entries went out

    def push(self, token: int, finish_reason: str | None) -> Piece | None:
        """The next token (-1: the request failed) and the request's finish_reason as it was when
        the engine gave the token; returns the piece to send, if any."""
        if token >= 0 and self.token_text is not None:
            self.offsets.append(self.chars)
            self.chars += len(self.utf8.decode(self.token_text.visible(token)))
        if self.finished:
            return None
        if token >= 0:
            self.tokens += 1
            fresh, stable = self.detokenizer.push(token)
            if stable:
                self.unsent, self.pending = self.unsent + fresh, ""
            else:
                self.pending = fresh        # the text of every token since the last stable one
        window = self.unsent + self.pending             # the text after what was given out
        text = self._cut(window, finish_reason)
        if text is None:
            return None
        self.sent += len(text)
        if self.finished or not (self.unsent or self.pending):
            self.settled = self.tokens
        entries = self._entries(self.sent)
        if text or entries or self.finished:
            return Piece(self.index, text, entries, self.finished)
        return None

    def _cut(self, window: str, finish_reason: str | None) -> str | None:
        """The part of `window` to give out now; None: nothing until the next token."""
        hit = min((i for i in (window.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.req.cancel()
            self.finished, self.finish_reason = True, FinishReason.STOP
            return window[:hit]
        if finish_reason:
            self.finished, self.finish_reason = True, finish_reason
            return window
        if window.endswith(REPLACEMENT):
            return None
        # all but the held-back tail, and only text that is stable (a decoder's text for tokens
        # that add none yet can still change)
        cut = min(max(0, len(window) - self.hold), len(self.unsent))
        self.unsent = self.unsent[cut:]
        return window[:cut]

    def _entries(self, upto: int) -> list[Entry]:
        """The entries of the tokens not yet given that start before character `upto`: a token cut
        off by a stop string, or one that adds nothing to the text at its end (end of sequence),
        is not reported."""
        if self.token_text is None:
            return []
        out = []
        steps = self.req.token_logprobs
        while self.given < min(len(self.offsets), len(steps)) and self.offsets[self.given] < upto:
            i = self.given
            out.append(Entry(self.req.token_ids[i], steps[i][0], steps[i][1], self.offsets[i]))
            self.given += 1
        return out


class TokenFeed:
    """The tokens of a request's choices, queued by the engine thread for the request's thread."""

    def __init__(self, streams: list[ChoiceStream], metrics: Metrics):
        self.streams, self.metrics = streams, metrics
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        for s in streams:
            s.req.on_token = self._on_token(s.index)

    def _on_token(self, index: int):
        put, count = self.queue.put, self.metrics.token

        def on_token(req: Request, token: int) -> None:     # the engine thread: keep it cheap
            if token >= 0:
                count()
            put((index, token, req.finish_reason))
        return on_token

    def pieces(self, gone: Callable[[], bool] | None = None) -> Iterator[Piece]:
        """Each choice's pieces, in the order their tokens came, until every choice has ended.
        With `gone`: asked every POLL_SECONDS; ClientGone once it says so."""
        left, asked = len(self.streams), time.monotonic()
        while left:
            if gone is not None and time.monotonic() - asked >= POLL_SECONDS:
                if gone():
                    raise ClientGone
                asked = time.monotonic()
            try:
                index, token, finish_reason = self.queue.get(timeout=POLL_SECONDS if gone else None)
            except queue.Empty:
                continue
            piece = self.streams[index].push(token, finish_reason)
            if piece is not None:
                left -= piece.finished
                yield piece
