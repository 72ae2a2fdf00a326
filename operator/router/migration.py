"""What a stream has given its client so far, and the request that continues it on another replica
when its replica fails mid-stream. Pure: chunks in, chunks out.

The router has no tokenizer, so it asks each replica for token ids (`return_token_ids`, vLLM's
extension, which shardwise's server implements): the first chunk carries the prompt's ids and the
completion bound in force, each chunk the ids of its tokens. A continuation is then a
/v1/completions request whose prompt is the prompt's ids followed by the ids already generated, for
the tokens left of the bound: the replica sees exactly the sequence the failed one had, so a greedy
answer goes on as it would have. This serves chat too, with no chat template in the router: the
prompt ids are the rendered conversation, and the continuation's text chunks are rewritten as chat
deltas. The client sees one stream: the first replica's id, created and model on every chunk, the
token-id fields removed unless it asked for them, and usage counted over the whole answer.

Limits (docs/openai-api.md): one choice (n = 1) only; logprobs of a migrated chat stream stop at the
migration; with stop strings, text a replica held back (up to the longest stop string less one
character) when it failed is lost; sampled (non-greedy) answers continue with the same
parameters but not the same random draws.
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

TOKEN_FIELDS = ("prompt_token_ids", "max_tokens")


class Event(enum.Enum):
    CHUNK = "chunk"         # a chunk to give the client (possibly rewritten)
    SKIP = "skip"           # nothing to give (a field-only chunk, the continuation's role chunk)
    DONE = "done"           # [DONE]: the answer is complete
    FAILED = "failed"       # an error object or a chunk that does not parse: the replica failed


def migratable(body: dict) -> bool:
    """Whether a request can move mid-stream: streamed, one choice."""
    return body.get("stream") is True and body.get("n") in (None, 1)


def with_token_ids(body: dict) -> dict:
    return {**body, "return_token_ids": True}


# The first replica's chunks are passed on without being decoded (the hot path): the fields the
# router needs are found, and its own fields cut out, by these patterns. They cannot match inside a
# JSON string, where every quote is escaped (`\"`), so a text that spells a field changes nothing.
IDS = re.compile(rb',\s*"token_ids"\s*:\s*\[([0-9,\s]*)\]')
FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')


def _numbers(raw: bytes) -> list[int]:
    return [int(x) for x in raw.replace(b",", b" ").split()]


@dataclass
class StreamState:
    """One streamed answer as the client has seen it.

    A replica reports a token's id once all of its text has been given out and nothing after it
    (its text is "settled"); text after the last settled token (an incomplete character, a tail held
    back for stop strings) may still change. So a continuation starts from the settled tokens, and
    the text the client saw beyond them (`unsettled` characters) is dropped from the start of the
    continuation's text, which repeats it exactly for a greedy answer."""
    chat: bool
    client_ids: bool = False        # the client asked for return_token_ids itself
    prompt_ids: list[int] | None = None
    max_tokens: int | None = None
    generated: list[int] = field(default_factory=list)     # settled tokens' ids
    finished: bool = False          # a finish_reason was given
    migrations: int = 0
    head: dict | None = None        # the first chunk's id, created, model, object
    unsettled: int = 0              # characters the client saw beyond the settled tokens' text
    unsettled_raw: list[bytes] = field(default_factory=list)   # undecoded chunks of those characters
    skip: int = 0                   # characters of the serving replica's text the client already saw

    @classmethod
    def of(cls, body: dict, chat: bool) -> "StreamState":
        return cls(chat, client_ids=body.get("return_token_ids") is True)

    @property
    def can_continue(self) -> bool:
        return self.prompt_ids is not None and self.max_tokens is not None and not self.finished

    def feed(self, data: bytes) -> tuple[Event, bytes | None]:
        """One SSE event's data from the replica now serving the stream: what to do, and the data
        to give the client."""
        if data == b"[DONE]":
            return Event.DONE, None
        m = IDS.search(data)
        if self.head is None or self.migrations or (m is None and b'"token_ids"' in data):
            return self._decoded(data)
        if data.startswith(b'{"error"'):
            return Event.FAILED, None
        if m and m.group(1).strip():
            self.generated.extend(_numbers(m.group(1)))
            self.unsettled, self.unsettled_raw = 0, []
        else:
            self.unsettled_raw.append(data)
        if FINISHED.search(data):
            self.finished = True
        if not self.client_ids and m:
            data = IDS.sub(b"", data)
        return Event.CHUNK, data

    def _decoded(self, data: bytes) -> tuple[Event, bytes | None]:
        """The first chunk, and a continuation's: decoded, rewritten, encoded."""
        try:
            obj = json.loads(data)
        except ValueError:
            return Event.FAILED, None
        if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list) \
                or not all(isinstance(c, dict) for c in obj["choices"]):
            return Event.FAILED, None
        if self.head is None:
            self.head = {k: obj.get(k) for k in ("id", "created", "model", "object")}
        if isinstance(obj.get("prompt_token_ids"), list) and self.prompt_ids is None:
            self.prompt_ids = [t for t in obj["prompt_token_ids"] if isinstance(t, int)]
            if isinstance(obj.get("max_tokens"), int):
                self.max_tokens = obj["max_tokens"]
        before = len(self.generated)
        if self.migrations:
            obj = self._continued(obj)
        for c in obj["choices"]:
            self._account(c)
        if self.migrations and not obj["choices"] and not obj.get("usage") and len(self.generated) == before:
            return Event.SKIP, None
        return Event.CHUNK, json.dumps(self._strip(obj), separators=(",", ":")).encode()

    def _text(self, c: dict) -> tuple[str, dict | None, str]:
        key, holder = ("content", c.get("delta")) if self.chat else ("text", c)
        text = holder.get(key) if isinstance(holder, dict) else None
        return (text if isinstance(text, str) else ""), holder, key

    def _account(self, c: dict) -> None:
        """Count a choice's text and ids; cut what the client already saw (a continuation's start)."""
        text, holder, key = self._text(c)
        visible = text[self.skip:]
        self.skip = max(0, self.skip - len(text))
        if visible != text:
            holder[key] = visible
        ids = c.get("token_ids")
        if isinstance(ids, list) and ids:
            self.generated.extend(t for t in ids if isinstance(t, int))
            self.unsettled = self.skip      # what the client saw beyond this chunk's end
        else:
            self.unsettled += len(visible)
        if c.get("finish_reason"):
            self.finished = True

    def moved(self) -> None:
        """The stream goes on elsewhere, from the settled tokens."""
        for raw in self.unsettled_raw:      # the first replica's undecoded chunks
            try:
                choices = json.loads(raw).get("choices") or []
            except (ValueError, AttributeError):
                continue
            self.unsettled += sum(len(self._text(c)[0]) for c in choices if isinstance(c, dict))
        self.unsettled_raw = []
        self.migrations += 1
        self.skip = self.unsettled

    def _strip(self, obj: dict) -> dict:
        if not self.client_ids:
            for f in TOKEN_FIELDS:
                obj.pop(f, None)
            for c in obj["choices"]:
                c.pop("token_ids", None)
        return obj

    def _continued(self, obj: dict) -> dict:
        """A continuation's chunk (a /v1/completions stream) as a chunk of the client's stream."""
        obj.pop("prompt_token_ids", None)
        obj.pop("max_tokens", None)
        obj.update(self.head or {})
        if obj.get("usage"):
            prompt, done = len(self.prompt_ids or []), len(self.generated)
            obj["usage"] = {**obj["usage"], "prompt_tokens": prompt, "completion_tokens": done,
                            "total_tokens": prompt + done}
        if self.chat:
            obj["choices"] = [self._as_chat(c) for c in obj["choices"]]
        return obj

    @staticmethod
    def _as_chat(c: dict) -> dict:
        out = {"index": 0, "delta": {"content": c.get("text") or ""} if not c.get("finish_reason") else {},
               "logprobs": None, "finish_reason": c.get("finish_reason")}
        if "token_ids" in c:
            out["token_ids"] = c["token_ids"]
        return out

    def continuation(self, body: dict) -> dict | None:
        """The /v1/completions body that continues the stream, or None when nothing is left to
        generate (the bound is reached) or the replica gave no token ids."""
        if not self.can_continue:
            return None
        left = self.max_tokens - len(self.generated)
        if left <= 0:
            return None
        out = {"prompt": self.prompt_ids + self.generated, "max_tokens": left, "stream": True,
               "return_token_ids": True}
        for k in ("model", "temperature", "top_p", "seed", "stop", "stream_options", "user"):
            if k in body:
                out[k] = body[k]
        if not self.chat and "logprobs" in body:
            out["logprobs"] = body["logprobs"]
        return out

    def closing(self) -> list[dict]:
        """The chunks that end a stream whose bound was reached exactly when its replica failed."""
        choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if self.chat else
                  {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
        self.finished = True
        return [{**(self.head or {}), "choices": [choice]}]
