"""OpenAI-compatible HTTP API on rank 0 (stdlib ThreadingHTTPServer + prometheus-client).

    POST /v1/completions          prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions     messages -> chat template -> text; "stream": true for SSE
    GET  /v1/models               the one model served, with its context length (max_model_len)
    GET  /v1/models/{id}          that model, or 404 model_not_found
    GET  /healthz                 200 once every rank has loaded its shard, 503 before
    GET  /metrics                 Prometheus text format

Request threads only tokenize, submit to the engine and wait; one engine thread owns every
torch.distributed call and batches whatever requests are running at each step. A bad request
gets a 4xx JSON error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and the
server keeps serving. What of the OpenAI API is implemented: docs/openai-api.md.
"""
from __future__ import annotations

import codecs
import json
import queue
import re
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from shardwise.crds.contract import DRAIN_SECONDS

from shardwise.worker.serving.engine import Request
from shardwise.worker.errors import WorkerError

MAX_BODY = 4 << 20
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MAX_N = 16              # choices per request (each one a request in the engine)
MAX_LOGPROBS = 20       # top_logprobs / completions' logprobs, OpenAI's bound
# Chat roles accepted. "developer" is OpenAI's newer name for "system" (what its client sends to
# reasoning models); chat templates only know "system", so it is rendered as one. "tool" goes to
# the template as is: one that cannot render it raises, which answers 400 naming the template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters this server does not implement, with the values that mean "off": any other value
# is refused rather than silently ignored (a caller relying on it would get a different answer).
UNSUPPORTED = {
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ExpertLoad:
    """Prometheus collector of a mixture-of-experts model's load balance, read at scrape time from
    the layers rank 0 holds (with pipeline stages: the first stage's layers):
    shardwise_expert_tokens_total{layer,expert} and shardwise_expert_imbalance{layer} (max/mean)."""

    def __init__(self, model):
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from shardwise.worker.model.moe import expert_load, imbalance
        tokens = CounterMetricFamily("shardwise_expert_tokens", "Tokens routed to each expert",
                                     labels=["layer", "expert"])
        ratio = GaugeMetricFamily("shardwise_expert_imbalance",
                                  "Most tokens any expert got over the mean per expert (1: balanced)",
                                  labels=["layer"])
        model = self.model()
        for layer, counts in (expert_load(model) if model is not None else {}).items():
            for e, n in enumerate(counts):
                tokens.add_metric([layer, str(e)], n)
            ratio.add_metric([layer], imbalance(counts))
        return [tokens, ratio]


class KVCacheUse:
    """Prometheus collector of the paged KV cache (engine.py, kv_blocks.py), read at scrape time:
    shardwise_kv_cache_blocks{state} (used: held by requests; cached: kept for prefix reuse,
    reclaimable; free), shardwise_kv_cache_block_tokens, and counters of prompt tokens reused
    from the cache and of preempted requests."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        engine = self.engine()
        if engine is None:
            return []
        pool = engine.pool
        blocks = GaugeMetricFamily("shardwise_kv_cache_blocks", "KV-cache blocks by state", labels=["state"])
        blocks.add_metric(["used"], pool.used)
        blocks.add_metric(["cached"], len(pool.evictable))
        blocks.add_metric(["free"], len(pool.free))
        size = GaugeMetricFamily("shardwise_kv_cache_block_tokens", "Token positions per KV-cache block",
                                 value=pool.block_size)
        reused = CounterMetricFamily("shardwise_prefix_reused_tokens", "Prompt tokens found in the KV "
                                     "cache instead of prefilled", value=engine.stats["reused_tokens"])
        preempted = CounterMetricFamily("shardwise_preempted_requests", "Requests preempted when the "
                                        "KV cache ran out of blocks", value=engine.stats["preempted"])
        return [blocks, size, reused, preempted]


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        r = self.registry = CollectorRegistry()
        self.latency = Histogram("shardwise_request_latency_seconds", "Time from request to last token",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("shardwise_time_to_first_token_seconds", "Time from request to first token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("shardwise_requests_total", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.generated = Counter("shardwise_generated_tokens_total", "Tokens generated", registry=r)
        self.prompt = Counter("shardwise_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.tps = Gauge("shardwise_tokens_per_second", "Generated tokens per second over the last 10 s",
                         registry=r)
        self.weight_bytes = Gauge("shardwise_weight_bytes", "Bytes of weights held by each rank",
                                  ["rank", "stage", "tp_rank"], registry=r)
        self.comm = Gauge("shardwise_communication_seconds_total",
                          "Seconds this rank spent in collectives and send/recv", ["rank"], registry=r)
        self.running = Gauge("shardwise_running_requests", "Requests being decoded", registry=r)
        self.waiting = Gauge("shardwise_waiting_requests", "Requests waiting for a cache slot", registry=r)
        self.ready = Gauge("shardwise_ready", "1 once every rank has loaded", registry=r)
        self.model = None          # rank 0's stage, for the mixture-of-experts load (ExpertLoad)
        r.register(ExpertLoad(lambda: self.model))
        self.engine = None         # for the KV cache's use (KVCacheUse)
        r.register(KVCacheUse(lambda: self.engine))
        self._window: deque = deque()
        self._lock = threading.Lock()

    def token(self, n: int = 1) -> None:
        self.generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n))

    def render(self, engine, rank: int) -> bytes:
        from prometheus_client import generate_latest

        from shardwise.worker.distributed.tensor_parallel import COMM
        now = time.monotonic()
        with self._lock:
            while self._window and self._window[0][0] < now - 10:
                self._window.popleft()
            self.tps.set(sum(n for _, n in self._window) / 10.0)
        self.comm.labels(rank=str(rank)).set(COMM.seconds)
        if engine is not None:
            self.running.set(engine.running)
            self.waiting.set(len(engine.waiting))
        return generate_latest(self.registry)


def _error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error object: every error this server sends has this one shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """The bytes and the display string of single tokens, for logprobs. A token can be part of a
    UTF-8 character: its string is then OpenAI's "bytes:\\xNN" form and `bytes` has the truth."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tok = getattr(tokenizer, "tok", None)
        self.byte_level = self.tok is not None and type(self.tok.decoder).__name__ == "ByteLevel"
        added = self.tok.get_added_tokens_decoder() if self.tok is not None else {}
        self.added = {i: t.content for i, t in added.items()}
        self.special = {i for i, t in added.items() if t.special}
        self.unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._cache[tid] = self._bytes(tid)
        return b

    def _bytes(self, tid: int) -> bytes:
        if self.tok is None:
            return self.tokenizer.decode([tid], skip_special=False).encode()
        piece = self.tok.id_to_token(tid)
        if piece is None:                       # a padded vocabulary row with no token
            return b""
        if tid in self.added:
            return self.added[tid].encode()
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)       # SentencePiece byte fallback
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def visible(self, tid: int) -> bytes:
        """What the token adds to the decoded text (special tokens are skipped when decoding)."""
        return b"" if tid in self.special else self.bytes(tid)

    def text(self, tid: int) -> str:
        b = self.bytes(tid)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _lp(x: float) -> float:
    """A log-probability JSON can carry: -inf and NaN become -9999.0, as OpenAI reports them."""
    return x if x == x and x > -9999.0 else -9999.0


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Job:
    """One API request: n engine requests for the same prompt, and how to answer."""
    reqs: list[Request]
    stop: list[str]
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: bool


class App:
    """State shared by the request threads: engine, tokenizer, readiness, metrics."""

    def __init__(self, model_name: str, tokenizer, rank: int = 0, max_tokens_default: int = 16):
        self.model_name, self.tokenizer, self.rank = model_name, tokenizer, rank
        self.engine = None
        self.loaded: list[dict] = []
        self.ready = threading.Event()
        self.draining = threading.Event()      # set on SIGTERM: finish what runs, take nothing new
        self.failed: str | None = None
        self.metrics = Metrics()
        self.max_tokens_default = max_tokens_default    # /v1/completions without max_tokens
        self.created = int(time.time())
        self._token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def set_ready(self, engine, loaded: list[dict]) -> None:
        for r in loaded:
            self.metrics.weight_bytes.labels(rank=str(r["rank"]), stage=str(r["stage"]),
                                             tp_rank=str(r["tp_rank"])).set(r["weight_bytes"])
        self.engine = engine
        self.metrics.model, self.metrics.engine = engine.stage.model, engine
        self.ready.set()
        self.metrics.ready.set(1)

    def set_failed(self, message: str) -> None:
        self.failed = message
        self.ready.clear()
        self.metrics.ready.set(0)

    def model_card(self) -> dict:
        # max_model_len: vLLM's name for the context length (prompt + completion tokens), which
        # routers and clients written against vLLM already read; null until the model has loaded.
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "shardwise",
                "max_model_len": self.engine.max_seq if self.engine is not None else None}

    def check_model(self, model) -> None:
        # The server answers to exactly one name: the id /v1/models reports (--model as given, or the
        # contract's serving.model_name). A router or gateway in front of several models picks the
        # backend by this field; answering another name with this model's text would hide a routing
        # mistake, so any other name is 404 model_not_found, as OpenAI answers. A request without
        # `model` (or null) is still served, as it always has been: it cannot mean another model, and
        # the curl examples and single-model clients leave it out.
        if model is None or model == self.model_name:
            return
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", param="model")
        raise BadRequest(f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                         404, "model", "model_not_found")

    # ---- request parsing ----
    def _messages(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
        rendered = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", param=where)
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise BadRequest(f"'{where}.role' is {role!r}; valid roles are: {', '.join(CHAT_ROLES)}",
                                 param=f"{where}.role")
            content = m.get("content")
            if isinstance(content, list):
                # text parts are joined with newlines, as vLLM does
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": string}}; "
                                     f"only text is supported", param=f"{where}.content")
                content = "\n".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"'{where}.content' must be a string or a list of text parts",
                                 param=f"{where}.content")
            rendered.append({**m, "role": "system" if role == "developer" else role, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
        except WorkerError as e:
            raise BadRequest(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template's own error (jinja2 runs it) is the request's
            raise BadRequest(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None
        return self.tokenizer.encode(text)

    def _prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
            vocab = self.engine.stage.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be a string or a non-empty list of token ids", param="prompt")

    def build_request(self, body: dict, chat: bool) -> Job:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        self.check_model(body.get("model"))
        for name, off in UNSUPPORTED.items():
            if name in body and not off(body[name]):
                raise BadRequest(f"'{name}' is not supported by this server (leave it out)", param=name)
        ids = self._messages(body.get("messages")) if chat else self._prompt(body.get("prompt"))
        what = "messages" if chat else "prompt"

        max_tokens = body.get("max_tokens")
        param = "max_tokens"
        if body.get("max_completion_tokens") is not None:
            max_tokens, param = body["max_completion_tokens"], "max_completion_tokens"
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        top_p = body.get("top_p")
        top_p = 1.0 if top_p is None else top_p
        seed = body.get("seed")
        stop = body.get("stop") or []
        n = body.get("n")
        n = 1 if n is None else n
        stream = body.get("stream") or False
        options = body.get("stream_options")
        if max_tokens is not None and (not _int(max_tokens) or max_tokens < 1):
            raise BadRequest(f"'{param}' must be a positive integer", param=param)
        if not _number(temperature) or not 0 <= temperature <= 2:
            raise BadRequest("'temperature' must be a number in [0, 2]", param="temperature")
        if not _number(top_p) or not 0 < top_p <= 1:
            raise BadRequest("'top_p' must be a number in (0, 1]", param="top_p")
        if not _int(n) or not 1 <= n <= MAX_N:
            raise BadRequest(f"'n' must be an integer from 1 to {MAX_N}", param="n")
        if seed is not None and (not _int(seed) or not -2**63 <= seed <= 2**64 - n):
            # choice i samples with seed + i; torch takes seeds in [-2^63, 2^64)
            raise BadRequest("'seed' must be an integer in [-2^63, 2^64 - n]", param="seed")
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a string or a list of non-empty strings", param="stop")
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean", param="stream")
        include_usage = False
        if options is not None:
            if not stream:
                raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
            if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
                raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}",
                                 param="stream_options")
            include_usage = options.get("include_usage", False)
        top = self._logprobs(body, chat)

        # The context holds prompt + completion; a completion that cannot fit is refused up front
        # (OpenAI's wording), not cut short. Without max_tokens, chat generates until the context
        # ends (OpenAI's default for chat) and completions stop at max_tokens_default (16, OpenAI's
        # default for /v1/completions), or at the context's end if that comes first.
        context = self.engine.max_seq
        if len(ids) >= context:
            raise BadRequest(f"This model's maximum context length is {context} tokens. However, the {what} "
                             f"is {len(ids)} tokens, which leaves no room for the completion. Please reduce "
                             f"the length of the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise BadRequest(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} in the "
                             f"completion). Please reduce the length of the {what} or completion.",
                             param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - len(ids) if chat else self.max_tokens_default

        reqs = [Request(ids, max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                        seed=None if seed is None else seed + i, logprobs=top) for i in range(n)]
        try:
            self.engine.check(reqs[0])
        except WorkerError as e:
            raise BadRequest(str(e)) from None
        return Job(reqs, stop, chat, stream, include_usage, top is not None)

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> int | None:
        """How many top alternatives each token reports; None: no logprobs at all."""
        bound = f"an integer from 0 to {MAX_LOGPROBS}"
        if not chat:   # /v1/completions: logprobs: k
            k = body.get("logprobs")
            if k is not None and (not _int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise BadRequest(f"'logprobs' must be {bound}", param="logprobs")
            return k
        want, k = body.get("logprobs"), body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest("'logprobs' must be a boolean", param="logprobs")
        if k is not None:
            if not _int(k) or not 0 <= k <= MAX_LOGPROBS:
                raise BadRequest(f"'top_logprobs' must be {bound}", param="top_logprobs")
            if not want:
                raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        return (k or 0) if want else None


class _Stream:
    """Turns one choice's tokens from the engine thread into text pieces for the request thread,
    applying stop strings and holding back incomplete UTF-8 characters. Each event on `out` is
    (index, text piece, logprob entries of the tokens the piece covers, finished)."""

    def __init__(self, index: int, req: Request, tokenizer, stop: list[str], metrics: Metrics,
                 out: queue.Queue, token_text: TokenText | None = None):
        self.index, self.req, self.tokenizer, self.stop, self.metrics = index, req, tokenizer, stop, metrics
        self.out, self.token_text = out, token_text
        self.sent = ""
        self.finished = False
        # logprobs: each token's character offset in the completion, from the bytes it adds
        self.offsets: list[int] = []
        self.chars = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.given = 0                       # tokens whose logprob entries went out
        req.on_token = self._on_token

    def _on_token(self, req: Request, token: int) -> None:
        if token >= 0:
            self.metrics.token()
            if self.token_text is not None:
                self.offsets.append(self.chars)
                self.chars += len(self.utf8.decode(self.token_text.visible(token)))
        if self.finished:
            return
        text = self.tokenizer.decode(req.token_ids)
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            text = text[:hit]
            req.cancel()
            req.finish_reason = "stop"
            self.finished = True
        elif req.finish_reason:
            self.finished = True
        elif text.endswith("\ufffd"):
            return
        else:
            # hold back a tail that could still grow into a stop string
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[:len(text) - hold] if hold else text
        piece = ""
        if len(text) > len(self.sent):
            piece = text[len(self.sent):]
            self.sent = text
        entries = self._entries(len(self.sent))
        if piece or entries or self.finished:
            self.out.put((self.index, piece, entries, self.finished))

    def _entries(self, upto: int) -> list[tuple]:
        """(token, logprob, top alternatives, offset) of the tokens not yet given that start
        before character `upto`: a token cut off by a stop string, or one that adds nothing to the
        text at its end (end of sequence), is not reported."""
        if self.token_text is None:
            return []
        out = []
        steps = self.req.token_logprobs
        while self.given < min(len(self.offsets), len(steps)) and self.offsets[self.given] < upto:
            i = self.given
            out.append((self.req.token_ids[i], steps[i][0], steps[i][1], self.offsets[i]))
            self.given += 1
        return out


def _completion_logprobs(tt: TokenText, entries: list[tuple]) -> dict:
    return {"tokens": [tt.text(t) for t, _, _, _ in entries],
            "token_logprobs": [_lp(lp) for _, lp, _, _ in entries],
            "top_logprobs": [{tt.text(a): _lp(alp) for a, alp in alts} for _, _, alts, _ in entries],
            "text_offset": [off for _, _, _, off in entries]}


def _chat_logprobs(tt: TokenText, entries: list[tuple]) -> dict:
    def one(t, lp):
        return {"token": tt.text(t), "logprob": _lp(lp), "bytes": list(tt.bytes(t))}
    return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                        for t, lp, alts, _ in entries],
            "refusal": None}


def make_handler(app: App):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "shardwise"

        def log_message(self, fmt, *args):  # quiet: metrics carry the request figures
            pass

        # ---- plumbing ----
        def _send(self, status: int, body: bytes, ctype: str = "application/json", endpoint: str = "") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if status == 503 and app.draining.is_set():
                self.send_header("Retry-After", "1")      # another replica, or this one's successor
            self.end_headers()
            self.wfile.write(body)
            app.metrics.requests.labels(endpoint=endpoint or self.path, code=str(status)).inc()

        def _json(self, status: int, obj, endpoint: str = "") -> None:
            self._send(status, json.dumps(obj).encode(), endpoint=endpoint)

        def _error(self, status: int, message: str, endpoint: str = "", param: str | None = None,
                   code: str | None = None) -> None:
            self._send(status, _error_body(message, status, param, code), endpoint=endpoint)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                if app.draining.is_set():      # unready first, so that the endpoints drop this pod
                    self._json(503, {"status": "draining", "running": app.engine.running if app.engine else 0},
                               "/healthz")
                elif app.ready.is_set():
                    self._json(200, {"status": "ok", "model": app.model_name, "ranks": len(app.loaded)},
                               "/healthz")
                else:
                    self._json(503, {"status": "failed" if app.failed else "loading",
                                     **({"error": app.failed} if app.failed else {})}, "/healthz")
            elif path == "/metrics":
                self._send(200, app.metrics.render(app.engine, app.rank),
                           "text/plain; version=0.0.4; charset=utf-8", "/metrics")
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [app.model_card()]}, path)
            elif path.startswith("/v1/models/"):
                from urllib.parse import unquote
                try:
                    app.check_model(unquote(path[len("/v1/models/"):]))
                except BadRequest as e:
                    return self._error(e.status, str(e), "/v1/models", e.param, e.code)
                self._json(200, app.model_card(), "/v1/models")
            else:
                self._error(404, f"no route GET {path}", "other")

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._drain()
                return self._error(404, f"no route POST {path}", "other")
            try:
                body = self._read_json()
                if app.draining.is_set():
                    raise BadRequest("the server is shutting down; retry on another replica", 503)
                if not app.ready.is_set():
                    raise BadRequest(app.failed or "model is still loading", 503)
                self._complete(path, app.build_request(body, chat=path.endswith("chat/completions")))
            except BadRequest as e:
                self._error(e.status, str(e), path, e.param, e.code)
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as e:  # noqa: BLE001 - a bug, not the request: one line, a JSON 500
                print(f"shardwise serve: {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._error(500, f"internal error: {type(e).__name__}: {e}", path)

        def _drain(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if 0 < n <= MAX_BODY:
                self.rfile.read(n)

        def _read_json(self):
            try:
                n = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True
                raise BadRequest("a JSON body with Content-Length is required", 411) from None
            if n > MAX_BODY:
                self.close_connection = True
                raise BadRequest(f"body of {n} bytes is larger than {MAX_BODY}", 413)
            raw = self.rfile.read(n)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"body is not valid JSON: {e}") from None
            try:   # "\ud800" escapes parse, but no tokenizer takes a lone surrogate
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise BadRequest("body is not valid JSON: a string holds a lone UTF-16 surrogate") from None
            return body

        # ---- completions ----
        def _complete(self, path: str, job: Job) -> None:
            t0 = time.perf_counter()
            out: queue.Queue = queue.Queue()
            tt = app.token_text if job.logprobs else None
            for i, req in enumerate(job.reqs):
                _Stream(i, req, app.tokenizer, job.stop, app.metrics, out, tt)
            app.metrics.prompt.inc(sum(len(r.prompt_ids) for r in job.reqs))
            try:
                for req in job.reqs:
                    app.engine.submit(req)
            except WorkerError as e:
                for req in job.reqs:
                    req.cancel()
                raise BadRequest(str(e)) from None
            rid = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())

            def events():
                left = len(job.reqs)
                while left:
                    event = out.get()
                    left -= event[3]
                    yield event

            if job.stream:
                return self._stream(path, job, events(), rid, created, t0)
            texts = [""] * len(job.reqs)
            entries: list[list] = [[] for _ in job.reqs]
            for i, piece, got, _ in events():
                texts[i] += piece
                entries[i] += got
            for req in job.reqs:
                req.done.wait()
            failed = next((r.error for r in job.reqs if r.error), None)
            if failed:
                return self._error(503, failed, path)
            firsts = [r.first_token_at for r in job.reqs if r.first_token_at is not None]
            if firsts:
                app.metrics.ttft.labels(endpoint=path).observe(min(firsts) - job.reqs[0].created)
            app.metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
            choices = []
            for i, req in enumerate(job.reqs):
                choice = {"index": i, "finish_reason": req.finish_reason, "logprobs": None}
                if job.chat:
                    choice["message"] = {"role": "assistant", "content": texts[i]}
                    if job.logprobs:
                        choice["logprobs"] = _chat_logprobs(tt, entries[i])
                else:
                    choice["text"] = texts[i]
                    if job.logprobs:
                        choice["logprobs"] = _completion_logprobs(tt, entries[i])
                choices.append(choice)
            self._json(200, {"id": rid, "object": "chat.completion" if job.chat else "text_completion",
                             "created": created, "model": app.model_name, "choices": choices,
                             "usage": self._usage(job)}, path)

        def _stream(self, path: str, job: Job, events, rid: str, created: int, t0: float) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            first = True
            tt = app.token_text if job.logprobs else None

            def chunk(index, piece, finish=None, entries=None) -> dict:
                logprobs = None
                if entries:
                    logprobs = (_chat_logprobs if job.chat else _completion_logprobs)(tt, entries)
                if job.chat:
                    delta = piece if isinstance(piece, dict) else {"content": piece}
                    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish}
                obj = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
                       "created": created, "model": app.model_name, "choices": [choice]}
                if job.include_usage:      # OpenAI: null on every chunk but the last one
                    obj["usage"] = None
                return obj

            try:
                if job.chat:
                    for i in range(len(job.reqs)):
                        self._sse(chunk(i, {"role": "assistant", "content": ""}))
                for i, piece, entries, finished in events:
                    req = job.reqs[i]
                    if req.error:
                        for r in job.reqs:
                            r.cancel()
                        self._sse({"error": {"message": req.error, "type": "server_error", "param": None,
                                             "code": None}})
                        break
                    if piece or entries:
                        if first:
                            app.metrics.ttft.labels(endpoint=path).observe(time.perf_counter() - t0)
                            first = False
                        self._sse(chunk(i, piece, entries=entries))
                    if finished:
                        self._sse(chunk(i, {} if job.chat else "", req.finish_reason))
                else:
                    if job.include_usage:
                        self._sse({"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
                                   "created": created, "model": app.model_name, "choices": [],
                                   "usage": self._usage(job)})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                for r in job.reqs:
                    r.cancel()
            except Exception as e:  # noqa: BLE001 - a bug mid-stream: the headers are sent, so an event
                for r in job.reqs:
                    r.cancel()
                print(f"shardwise serve: {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._sse({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                     "type": "server_error", "param": None, "code": None}})
                self.wfile.write(b"data: [DONE]\n\n")
            finally:
                app.metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
                app.metrics.requests.labels(endpoint=path, code="200").inc()

        @staticmethod
        def _usage(job: Job) -> dict:
            # the prompt counts once however many choices were generated from it, as OpenAI counts
            prompt = len(job.reqs[0].prompt_ids)
            completion = sum(len(r.token_ids) for r in job.reqs)
            # cached_tokens: the prompt's tokens found in the KV cache (prefix reuse), as OpenAI
            # reports its prompt caching
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                    "prompt_tokens_details": {"cached_tokens": job.reqs[0].reused_tokens}}

        def _sse(self, obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a client that hangs up (a probe, a cancelled stream) is not an error worth a traceback
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Server:
    def __init__(self, app: App, host: str, port: int):
        self.app = app
        self.httpd = _HTTPServer((host, port), make_handler(app))
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> "Server":
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run_engine(app: App, ctx, stop: threading.Event, micro_batches: int = 0,
               drain_seconds: float = DRAIN_SECONDS) -> None:
    """Rank 0's main loop once loaded: mark ready and step the engine until `stop` is set, then
    drain: /healthz turns 503 (a readiness probe takes the pod out of its Service's endpoints), new
    requests get 503 with Retry-After, and the running and queued ones go on to their end for up
    to `drain_seconds`. What is still running then ends with finish_reason "error" and a message
    saying why, rather than a connection cut mid-stream."""
    from shardwise.worker.serving.engine import Engine
    engine = Engine.for_rank(ctx, app.tokenizer.eos_ids, micro_batches)
    app.loaded = ctx.loaded
    app.set_ready(engine, ctx.loaded)
    drained = threading.Event()

    def drain() -> None:
        stop.wait()
        app.draining.set()
        deadline = time.monotonic() + drain_seconds
        while (engine.running or engine.waiting) and time.monotonic() < deadline:
            time.sleep(0.02)
        drained.set()

    threading.Thread(target=drain, name="drain", daemon=True).start()
    try:
        engine.run_forever(drained)
        if engine.running or engine.waiting:
            engine.fail_all(f"the server shut down before this request finished (drained for {drain_seconds:g} s)")
    except Exception as e:  # noqa: BLE001 - a rank died: fail requests, report unhealthy, exit
        msg = f"pipeline failed: {type(e).__name__}: {e}"
        app.set_failed(msg)
        engine.fail_all(msg)
        raise WorkerError(msg) from None
