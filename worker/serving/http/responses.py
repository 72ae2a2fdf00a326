"""The JSON of answers: a whole completion, the chunks of a streamed one, usage and logprobs, in
OpenAI's shapes for /v1/completions ("text_completion") and /v1/chat/completions."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from shardwise.worker.serving.request import Request
from shardwise.worker.serving.http.detokenize import TokenText
from shardwise.worker.serving.http.streaming import ChoiceStream, Entry


@dataclass
class Job:
    """One API request: n engine requests for the same prompt, and how to answer."""
    reqs: list[Request]
    stop: list[str]
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    token_ids: bool = False     # return_token_ids: the ids a router needs to continue a stream elsewhere


def lp(x: float) -> float:
    """A log-probability JSON can carry: -inf and NaN become -9999.0, as OpenAI reports them."""
    return x if x == x and x > -9999.0 else -9999.0


def completion_logprobs(tt: TokenText, entries: list[Entry]) -> dict:
    return {"tokens": [tt.text(t) for t, _, _, _ in entries],
            "token_logprobs": [lp(x) for _, x, _, _ in entries],
            "top_logprobs": [{tt.text(a): lp(alp) for a, alp in alts} for _, _, alts, _ in entries],
            "text_offset": [off for _, _, _, off in entries]}


def chat_logprobs(tt: TokenText, entries: list[Entry]) -> dict:
    def one(t, x):
        return {"token": tt.text(t), "logprob": lp(x), "bytes": list(tt.bytes(t))}
    return {"content": [{**one(t, x), "top_logprobs": [one(a, alp) for a, alp in alts]}
                        for t, x, alts, _ in entries],
            "refusal": None}


def usage(job: Job, streams: list[ChoiceStream]) -> dict:
    # the prompt counts once however many choices were generated from it, as OpenAI counts; a
    # choice counts its tokens up to the one that completed a stop string
    prompt = len(job.reqs[0].prompt_ids)
    completion = sum(s.tokens for s in streams)
    # cached_tokens: the prompt's tokens found in the KV cache (prefix reuse), as OpenAI
    # reports its prompt caching
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": job.reqs[0].reused_tokens}}


class Answer:
    """The answer's id, creation time and model, and the objects that carry its choices."""

    def __init__(self, job: Job, model_name: str, token_text: TokenText | None):
        self.job, self.model_name, self.token_text = job, model_name, token_text
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        self.ids_given = [0] * len(job.reqs)     # return_token_ids: each choice's ids sent so far
        self.first = True

    def _logprobs(self, entries: list[Entry]) -> dict:
        return (chat_logprobs if self.job.chat else completion_logprobs)(self.token_text, entries)

    def whole(self, streams: list[ChoiceStream], texts: list[str], entries: list[list[Entry]]) -> dict:
        """The complete answer of a request that does not stream."""
        choices = []
        for i, s in enumerate(streams):
            choice = {"index": i, "finish_reason": s.finish_reason, "logprobs": None}
            if self.job.chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
            else:
                choice["text"] = texts[i]
            if self.job.logprobs:
                choice["logprobs"] = self._logprobs(entries[i])
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage(self.job, streams)}

    def chunk(self, index: int, piece: str | dict, finish: str | None = None,
              entries: list[Entry] | None = None) -> dict:
        """One streamed chunk: a choice's text (chat: its delta), or its finish_reason."""
        logprobs = self._logprobs(entries) if entries else None
        if self.job.chat:
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [choice]}
        if self.job.include_usage:      # OpenAI: null on every chunk but the last one
            obj["usage"] = None
        return obj

    def with_token_ids(self, obj: dict, index: int, tokens: int) -> dict:
        """`obj` (a chunk of choice `index`) with return_token_ids' fields: the ids of the choice's
        tokens up to its `tokens`-th not sent yet, and on the stream's first chunk the prompt's ids
        and the completion bound in force (what a continuation elsewhere must respect). `tokens` is
        the count of settled tokens (all their text given out, nothing after it), so that a chunk
        with ids ends exactly where those tokens' text ends."""
        if not self.job.token_ids:
            return obj
        req = self.job.reqs[index]
        if self.first:
            obj["prompt_token_ids"], obj["max_tokens"] = list(req.prompt_ids), req.max_new_tokens
            self.first = False
        if obj["choices"]:
            obj["choices"][0]["token_ids"] = list(req.token_ids[self.ids_given[index]:tokens])
            self.ids_given[index] = max(self.ids_given[index], tokens)
        return obj

    def usage_chunk(self, streams: list[ChoiceStream]) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [], "usage": usage(self.job, streams)}
