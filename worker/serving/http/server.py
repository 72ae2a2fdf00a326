"""OpenAI-compatible HTTP API on rank 0 (http.server's request parsing on a bounded pool of threads,
connections.py, + prometheus-client).

    POST /v1/completions          prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions     messages -> chat template -> text; "stream": true for SSE
    GET  /v1/models               the one model served, with its context length (max_model_len)
    GET  /v1/models/{id}          that model, or 404 model_not_found
    GET  /healthz                 200 once every rank has loaded its shard, 503 before
    GET  /metrics                 Prometheus text format
    GET  /download                a remote model's pod: its fetch's final report (crds/download.py)

Request threads validate and tokenize, submit to the engine, and detokenize what it generates;
one engine thread owns every torch.distributed call and batches whatever requests are running at
each step. A bad request gets a 4xx JSON error in OpenAI's shape ({"error": {"message", "type",
"param", "code"}}) and the server keeps serving. What of the OpenAI API is implemented:
docs/openai-api.md. The other modules of this package: its __init__.
"""
from __future__ import annotations

import threading
import time

from shardwise.crds.contract import DRAIN_SECONDS, FLUSH_SECONDS

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.http.app import App
from shardwise.worker.serving.http.connections import WORKERS, Connection, ConnectionServer, Timeouts, workers_for
from shardwise.worker.serving.http.handler import make_handler

__all__ = ["App", "Server", "run_engine", "workers_for"]


class Server:
    """The API on (host, port): connections accepted and waited on by one thread, requests served
    by a pool of `workers` threads (connections.py says why not http.server's own)."""

    def __init__(self, app: App, host: str, port: int, workers: int = WORKERS, timeouts: Timeouts = Timeouts()):
        self.app = app
        self.handler = make_handler(app)
        self.connections = ConnectionServer(host, port, self._serve_one, workers, timeouts)
        self.thread = threading.Thread(target=self.connections.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.connections.address[1]

    def start(self) -> "Server":
        self.thread.start()
        return self

    def close(self, flush_seconds: float = FLUSH_SECONDS) -> None:
        """Stop accepting, then give the requests being answered up to `flush_seconds` to finish
        writing: the engine may have generated a stream's last tokens while its thread still
        writes the earlier ones, and the process exiting would cut the stream short without an
        error or its [DONE]."""
        self.connections.shutdown()
        self.connections.pool.wait_quiet(flush_seconds)

    def _serve_one(self, conn: Connection) -> bool:
        """One request on `conn` (a pool thread); whether the connection stays open after it."""
        if conn.handler is None:
            conn.handler = self.handler.on_connection(conn)
        conn.reader.deadline = time.monotonic() + conn.timeouts.headers
        conn.handler.close_connection = True
        conn.handler.handle_one_request()
        return not conn.handler.close_connection


def run_engine(app: App, ctx, stop: threading.Event, micro_batches: int = 0,
               drain_seconds: float = DRAIN_SECONDS) -> None:
    """Rank 0's main loop once loaded: mark ready and step the engine until `stop` is set, then
    drain: /healthz turns 503 (a readiness probe takes the pod out of its Service's endpoints), new
    requests get 503 with Retry-After, and the running and queued ones go on to their end for up
    to `drain_seconds`. What is still running then ends with finish_reason "error" and a message
    saying why, rather than a connection cut mid-stream. Requests beyond the engine's waiting queue
    (app.max_waiting choices, or the default for its batch) are refused with 429."""
    from shardwise.worker.serving import defaults
    from shardwise.worker.serving.engine import Engine
    waiting = app.max_waiting or defaults.max_waiting(ctx.spec.max_batch)
    engine = Engine.for_rank(ctx, app.tokenizer.eos_ids, micro_batches, max_waiting=waiting)
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
