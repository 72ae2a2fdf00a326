"""The HTTP side: routes, request bodies, and answers written plainly or as server-sent events.

Request threads (a pool's, one request at a time: connections.py) validate and tokenize, submit
to the engine, then turn the engine's tokens into text (streaming.py) and write it; the engine
thread only queues tokens. A request whose client has closed its connection is not submitted, or
is cancelled once that is seen (its socket is looked at every streaming.POLL_SECONDS). A request
the engine's waiting queue has no room for is answered 429 with Retry-After at once (app.refusal).
"""
from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

from shardwise.crds import names
from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.http.app import App, refusal
from shardwise.worker.serving.http.connections import Connection, client_gone
from shardwise.worker.serving.http.errors import BadRequest, error_body, error_object, internal_error
from shardwise.worker.serving.http.framing import body_length, parse_json
from shardwise.worker.serving.http.responses import Answer, Job
from shardwise.worker.serving.http.streaming import POLL_SECONDS, ChoiceStream, ClientGone, TokenFeed

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


class Handler(BaseHTTPRequestHandler):
    """One connection's requests; `app` is set on the subclass make_handler makes."""
    app: App
    protocol_version = "HTTP/1.1"
    server_version = "shardwise"

    @classmethod
    def on_connection(cls, conn: Connection) -> "Handler":
        """A handler for the requests of `conn`, one at a time (handle_one_request), read from its
        DeadlineReader and written with its SocketWriter."""
        h = cls.__new__(cls)
        h.request = h.connection = conn.sock
        h.client_address, h.server = conn.address, None
        h.rfile, h.wfile, h.timeouts = conn.reader, conn.writer, conn.timeouts
        return h

    def log_message(self, fmt, *args):  # quiet: metrics carry the request figures
        pass

    # ---- plumbing ----
    def _send(self, status: int, body: bytes, ctype: str = "application/json", endpoint: str = "",
              retry_after: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if status == 503 and self.app.draining.is_set():
            retry_after = 1                           # another replica, or this one's successor
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        self.wfile.write(body)
        self.app.metrics.requests.labels(endpoint=endpoint or self.path, code=str(status)).inc()

    def _json(self, status: int, obj, endpoint: str = "") -> None:
        self._send(status, json.dumps(obj).encode(), endpoint=endpoint)

    def _error(self, status: int, message: str, endpoint: str = "", param: str | None = None,
               code: str | None = None, retry_after: int | None = None) -> None:
        self._send(status, error_body(message, status, param, code), endpoint=endpoint, retry_after=retry_after)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """What http.server answers itself (a malformed request line or headers, an unknown
        method, an over-long URL), in OpenAI's error shape instead of an HTML page, always a 4xx;
        the connection closes, as the request was not understood."""
        self.close_connection = True
        # an unknown method is the request's fault, not the server's: 405 rather than 501; so is
        # an HTTP version other than 1.x: 400 rather than 505
        code = {501: 405, 505: 400}.get(code, code)
        if self.request_version == "HTTP/0.9":      # an unparsed request line: still give a status line
            self.request_version = "HTTP/1.0"
        body = error_body(message or self.responses.get(code, ("error",))[0], code)
        self.send_response(code, message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        if code == 405:
            self.send_header("Allow", "GET, POST")
        self.end_headers()
        if self.command != "HEAD" and code >= 200 and code not in (204, 304):
            self.wfile.write(body)
        self.app.metrics.requests.labels(endpoint="other", code=str(code)).inc()

    def _gone(self) -> bool:
        return client_gone(self.connection)

    def _sse(self, obj) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    # ---- GET ----
    def do_GET(self):  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        try:
            self._read_body()       # a GET may carry one: bounded like any other, then dropped
        except BadRequest as e:
            return self._error(e.status, str(e), "other")
        if path == "/healthz":
            self._healthz()
        elif path == "/metrics":
            self._send(200, self.app.metrics.render(self.app.engine, self.app.rank),
                       "text/plain; version=0.0.4; charset=utf-8", "/metrics")
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [self.app.model_card()]}, path)
        elif path == names.DOWNLOAD_PROGRESS_PATH and self.app.download is not None:
            self._send(200, self.app.download, endpoint=path)     # what the pod fetched before it loaded
        elif path.startswith("/v1/models/"):
            try:
                self.app.check_model(unquote(path[len("/v1/models/"):]))
            except BadRequest as e:
                return self._error(e.status, str(e), "/v1/models", e.param, e.code)
            self._json(200, self.app.model_card(), "/v1/models")
        else:
            self._error(404, f"no route GET {path}", "other")

    def _healthz(self) -> None:
        app = self.app
        if app.draining.is_set():      # unready first, so that the endpoints drop this pod
            self._json(503, {"status": "draining", "running": app.engine.running if app.engine else 0}, "/healthz")
        elif app.ready.is_set():
            # running and waiting: the load a router in front of several replicas weighs
            self._json(200, {"status": "ok", "model": app.model_name, "ranks": len(app.loaded),
                             "running": app.engine.running, "waiting": len(app.engine.waiting)}, "/healthz")
        else:
            self._json(503, {"status": "failed" if app.failed else "loading",
                             **({"error": app.failed} if app.failed else {})}, "/healthz")

    # ---- POST ----
    def do_POST(self):  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        known = path in COMPLETIONS
        if not self._authorized(path):
            return
        try:
            raw = self._read_body()
        except BadRequest as e:
            return self._error(e.status, str(e), path if known else "other")
        if not known:
            return self._error(404, f"no route POST {path}", "other")
        app = self.app
        try:
            body = parse_json(raw)
            if app.draining.is_set():
                raise BadRequest("the server is shutting down; retry on another replica", 503)
            if not app.ready.is_set():
                raise BadRequest(app.failed or "model is still loading", 503)
            self._complete(path, app.build_request(body, chat=path.endswith("chat/completions")))
        except BadRequest as e:
            self._error(e.status, str(e), path, e.param, e.code, e.retry_after)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug, not the request: one line, a JSON 500
            self._error(500, internal_error(path, e), path)

    def _authorized(self, path: str) -> bool:
        """Whether the request may go on; if not, it has been answered 401 (its body unread, so
        the connection closes). Only /v1/* needs a key, and only when the server has keys."""
        keys = self.app.api_keys
        if keys is None or not (path == "/v1" or path.startswith("/v1/")):
            return True
        refusal = keys.refusal(self.headers.get("Authorization"))
        if refusal is None:
            return True
        self.close_connection = True
        self._error(401, refusal, "other", code="invalid_api_key")
        return False

    def _read_body(self) -> bytes:
        """The request's body, its length checked first (framing.body_length); on a BadRequest
        the connection closes, since the body it declared was not read."""
        try:
            n = body_length(self.headers, self.command)
            if not n:
                return b""
            self.rfile.deadline = self.timeouts.body_deadline(n)
            raw = self.rfile.read(n)
        except BadRequest:
            self.close_connection = True
            raise
        except TimeoutError:
            self.close_connection = True
            raise BadRequest(f"the body did not arrive within {self.timeouts.body:g} s plus a second "
                             f"for each {self.timeouts.body_rate} bytes", 408) from None
        if len(raw) < n:            # the client closed its side before the whole body came
            self.close_connection = True
        return raw

    # ---- completions ----
    def _complete(self, path: str, job: Job) -> None:
        app = self.app
        t0 = time.perf_counter()
        tt = app.token_text if job.logprobs else None
        streams = [ChoiceStream(i, req, app.tokenizer, job.stop, tt) for i, req in enumerate(job.reqs)]
        feed = TokenFeed(streams, app.metrics)
        if self._gone():        # it asked and hung up (or gave up waiting): nothing to generate
            self.close_connection = True
            return
        try:
            app.engine.submit_all(job.reqs)     # all the choices or none (a full queue: 429)
        except WorkerError as e:
            raise refusal(e) from None
        app.metrics.prompt.inc(sum(len(r.prompt_ids) for r in job.reqs))
        answer = Answer(job, app.model_name, tt)
        if job.stream:
            return self._stream(path, feed, answer, t0)
        self._whole(path, feed, answer, t0)

    def _whole(self, path: str, feed: TokenFeed, answer: Answer, t0: float) -> None:
        """The answer as one JSON object, once every choice has ended."""
        reqs = answer.job.reqs
        texts: list[list[str]] = [[] for _ in reqs]
        entries: list[list] = [[] for _ in reqs]
        try:
            for i, text, got, _ in feed.pieces(self._gone):
                texts[i].append(text)
                entries[i] += got
            for req in reqs:
                while not req.done.wait(POLL_SECONDS):
                    if self._gone():
                        raise ClientGone
        except ClientGone:      # no one to answer: free the engine's rows and blocks for others
            for req in reqs:
                req.cancel()
            self.close_connection = True
            return
        failed = next((r.error for r in reqs if r.error), None)
        if failed:
            return self._error(503, failed, path)
        metrics = self.app.metrics
        firsts = [r.first_token_at for r in reqs if r.first_token_at is not None]
        if firsts:
            metrics.ttft.labels(endpoint=path).observe(min(firsts) - reqs[0].created)
        metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
        self._json(200, answer.whole(feed.streams, ["".join(t) for t in texts], entries), path)

    def _stream(self, path: str, feed: TokenFeed, answer: Answer, t0: float) -> None:
        """The answer as server-sent events, a chunk per piece of a choice's text."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        reqs = answer.job.reqs
        try:
            self._chunks(path, feed, answer, t0)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (ConnectionError, TimeoutError, ClientGone):
            for r in reqs:
                r.cancel()
        except Exception as e:  # noqa: BLE001 - a bug mid-stream: the headers are sent, so an event
            for r in reqs:
                r.cancel()
            self._sse(error_object(internal_error(path, e), 500))
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            self.app.metrics.latency.labels(endpoint=path).observe(time.perf_counter() - t0)
            self.app.metrics.requests.labels(endpoint=path, code="200").inc()

    def _chunks(self, path: str, feed: TokenFeed, answer: Answer, t0: float) -> None:
        job, first = answer.job, True
        if job.chat:
            for i in range(len(job.reqs)):
                self._sse(answer.with_token_ids(answer.chunk(i, {"role": "assistant", "content": ""}), i, 0))
        for i, text, entries, finished in feed.pieces(self._gone):
            req = job.reqs[i]
            if req.error:
                for r in job.reqs:
                    r.cancel()
                self._sse(error_object(req.error, 500))
                return
            if text or entries:
                if first:
                    self.app.metrics.ttft.labels(endpoint=path).observe(time.perf_counter() - t0)
                    first = False
                self._sse(answer.with_token_ids(answer.chunk(i, text, entries=entries), i, feed.streams[i].settled))
            if finished:
                self._sse(answer.with_token_ids(answer.chunk(i, {} if job.chat else "", feed.streams[i].finish_reason),
                                                i, feed.streams[i].settled))
        if job.include_usage:
            self._sse(answer.usage_chunk(feed.streams))


def make_handler(app: App) -> type[Handler]:
    """The handler class of a server that serves `app`."""
    return type("Handler", (Handler,), {"app": app})
