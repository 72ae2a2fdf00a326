"""OpenAI-compatible HTTP API on rank 0 (stdlib ThreadingHTTPServer + prometheus-client).

    POST /v1/completions          prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions     messages -> chat template -> text; "stream": true for SSE
    GET  /v1/models               the one model served
    GET  /healthz                 200 once every rank has loaded its shard, 503 before
    GET  /metrics                 Prometheus text format

Request threads only tokenize, submit to the engine and wait; one engine thread owns every
torch.distributed call and batches whatever requests are running at each step. A bad request
gets a 4xx JSON error ({"error": {"message", "type"}}) and the server keeps serving.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .engine import Request
from .errors import WorkerError

MAX_BODY = 4 << 20
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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
        self._window: deque = deque()
        self._lock = threading.Lock()

    def token(self, n: int = 1) -> None:
        self.generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, n))

    def render(self, engine, rank: int) -> bytes:
        from prometheus_client import generate_latest

        from .parallel import COMM
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


def _error_body(message: str, status: int) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


class App:
    """State shared by the request threads: engine, tokenizer, readiness, metrics."""

    def __init__(self, model_name: str, tokenizer, rank: int = 0, max_tokens_default: int = 16):
        self.model_name, self.tokenizer, self.rank = model_name, tokenizer, rank
        self.engine = None
        self.loaded: list[dict] = []
        self.ready = threading.Event()
        self.failed: str | None = None
        self.metrics = Metrics()
        self.max_tokens_default = max_tokens_default

    def set_ready(self, engine, loaded: list[dict]) -> None:
        for r in loaded:
            self.metrics.weight_bytes.labels(rank=str(r["rank"]), stage=str(r["stage"]),
                                             tp_rank=str(r["tp_rank"])).set(r["weight_bytes"])
        self.engine = engine
        self.ready.set()
        self.metrics.ready.set(1)

    def set_failed(self, message: str) -> None:
        self.failed = message
        self.ready.clear()
        self.metrics.ready.set(0)

    # ---- request parsing ----
    def build_request(self, body: dict, chat: bool) -> tuple[Request, list[str]]:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except WorkerError as e:
                raise BadRequest(str(e)) from None
            ids = self.tokenizer.encode(text)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                vocab = self.engine.stage.vocab_size
                if not all(0 <= t < vocab for t in prompt):
                    raise BadRequest(f"prompt token ids must be in [0, {vocab})")
                ids = list(prompt)
            else:
                raise BadRequest("'prompt' must be a string or a non-empty list of token ids")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", self.max_tokens_default))
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        seed = body.get("seed")
        stop = body.get("stop") or []
        n = body.get("n", 1)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("'max_tokens' must be a positive integer")
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise BadRequest("'temperature' must be a number in [0, 2]")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise BadRequest("'top_p' must be a number in (0, 1]")
        if seed is not None and not isinstance(seed, int):
            raise BadRequest("'seed' must be an integer")
        if n != 1:
            raise BadRequest("only n=1 is supported")
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a string or a list of non-empty strings")
        req = Request(ids, max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                      seed=seed)
        try:
            self.engine.check(req)
        except WorkerError as e:
            raise BadRequest(str(e)) from None
        return req, stop


class _Stream:
    """Turns tokens from the engine thread into text pieces for the request thread, applying
    stop strings and holding back incomplete UTF-8 characters."""

    def __init__(self, req: Request, tokenizer, stop: list[str], metrics: Metrics):
        self.req, self.tokenizer, self.stop, self.metrics = req, tokenizer, stop, metrics
        self.pieces: queue.Queue = queue.Queue()
        self.sent = ""
        self.finished = False
        req.on_token = self._on_token

    def _on_token(self, req: Request, token: int) -> None:
        if token >= 0:
            self.metrics.token()
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
        if len(text) > len(self.sent):
            self.pieces.put(text[len(self.sent):])
            self.sent = text
        if self.finished:
            self.pieces.put(None)

    def __iter__(self):
        while True:
            piece = self.pieces.get()
            if piece is None:
                return
            yield piece


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
            self.end_headers()
            self.wfile.write(body)
            app.metrics.requests.labels(endpoint=endpoint or self.path, code=str(status)).inc()

        def _json(self, status: int, obj, endpoint: str = "") -> None:
            self._send(status, json.dumps(obj).encode(), endpoint=endpoint)

        def _error(self, status: int, message: str, endpoint: str = "") -> None:
            self._send(status, _error_body(message, status), endpoint=endpoint)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                if app.ready.is_set():
                    self._json(200, {"status": "ok", "model": app.model_name, "ranks": len(app.loaded)},
                               "/healthz")
                else:
                    self._json(503, {"status": "failed" if app.failed else "loading",
                                     **({"error": app.failed} if app.failed else {})}, "/healthz")
            elif path == "/metrics":
                self._send(200, app.metrics.render(app.engine, app.rank),
                           "text/plain; version=0.0.4; charset=utf-8", "/metrics")
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": app.model_name, "object": "model",
                                                             "owned_by": "shardwise"}]}, path)
            else:
                self._error(404, f"no route GET {path}", "other")

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._drain()
                return self._error(404, f"no route POST {path}", "other")
            try:
                body = self._read_json()
                if not app.ready.is_set():
                    raise BadRequest(app.failed or "model is still loading", 503)
                self._complete(path, body, chat=path.endswith("chat/completions"))
            except BadRequest as e:
                self._error(e.status, str(e), path)
            except (BrokenPipeError, ConnectionResetError):
                pass

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
                return json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"body is not valid JSON: {e}") from None

        # ---- completions ----
        def _complete(self, path: str, body: dict, chat: bool) -> None:
            t0 = time.perf_counter()
            req, stop = app.build_request(body, chat)
            stream = _Stream(req, app.tokenizer, stop, app.metrics)
            app.metrics.prompt.inc(len(req.prompt_ids))
            try:
                app.engine.submit(req)
            except WorkerError as e:
                raise BadRequest(str(e)) from None
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            first = True
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    if chat:
                        self._sse(self._chunk(rid, created, chat, {"role": "assistant", "content": ""}, None))
                    for piece in stream:
                        if first:
                            app.metrics.ttft.labels(endpoint=path).observe(time.perf_counter() - t0)
                            first = False
                        self._sse(self._chunk(rid, created, chat, piece, None))
                    if req.error:
                        self._sse({"error": {"message": req.error, "type": "server_error"}})
                    else:
                        self._sse(self._chunk(rid, created, chat, {} if chat else "", req.finish_reason,
                                              usage=self._usage(req)))
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    req.cancel()
                    return
                finally:
                    app.metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
                    app.metrics.requests.labels(endpoint=path, code="200").inc()
                return
            text = "".join(stream)
            req.done.wait()
            if req.error:
                return self._error(503, req.error, path)
            if req.first_token_at is not None:
                app.metrics.ttft.labels(endpoint=path).observe(req.first_token_at - req.created)
            app.metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
            choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": app.model_name, "choices": [choice],
                             "usage": self._usage(req)}, path)

        @staticmethod
        def _usage(req: Request) -> dict:
            return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.token_ids),
                    "total_tokens": len(req.prompt_ids) + len(req.token_ids)}

        def _chunk(self, rid, created, chat, piece, finish, usage=None) -> dict:
            if chat:
                delta = piece if isinstance(piece, dict) else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": app.model_name, "choices": [choice]}
            if usage:
                out["usage"] = usage
            return out

        def _sse(self, obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


class Server:
    def __init__(self, app: App, host: str, port: int):
        self.app = app
        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((host, port), make_handler(app))
        self.httpd.daemon_threads = True
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


def run_engine(app: App, ctx, stop: threading.Event, max_batch: int, micro_batches: int = 0) -> None:
    """Rank 0's main loop once loaded: mark ready and step the engine until `stop` is set."""
    from .engine import Engine
    engine = Engine(ctx.stage, max_batch, ctx.max_seq, app.tokenizer.eos_ids, micro_batches)
    app.loaded = ctx.loaded
    app.set_ready(engine, ctx.loaded)
    try:
        engine.run_forever(stop)
    except Exception as e:  # noqa: BLE001 - a rank died: fail requests, report unhealthy, exit
        msg = f"pipeline failed: {type(e).__name__}: {e}"
        app.set_failed(msg)
        engine.fail_all(msg)
        raise WorkerError(msg) from None
