"""Request framing of the HTTP API (worker/serving/http/framing.py, handler.py), no ranks: a
Content-Length that is negative, not a number, missing or over the limit, chunked bodies and
malformed request lines each get a one-line 4xx in OpenAI's error shape, on every path, and the
server keeps serving. The fake engine and raw-socket helpers here serve the other test_http_*
files too."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from shardwise.worker.serving.http.server import App, Server

MAX_BODY = 4 << 20


class FakeTokenizer:
    """Bytes as tokens: what the HTTP side needs of a tokenizer, without a model."""
    eos_ids = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class FakeEngine:
    """Generates "ab" repeated, one token every `delay` seconds, on a thread per request;
    remembers every request it was given (cancelled ones included)."""
    max_seq = 4096
    running = 0
    waiting = ()            # the real engine's queue: a sized collection

    class stage:
        vocab_size = 256
        model = None

    def __init__(self, delay: float = 0.001):
        self.delay, self.seen = delay, []

    def check(self, req, sequences: int = 1) -> None:
        pass

    def submit(self, req):
        self.seen.append(req)
        threading.Thread(target=self._generate, args=(req,), daemon=True).start()
        return req

    def submit_all(self, reqs) -> None:
        for req in reqs:
            self.submit(req)

    def _generate(self, req) -> None:
        for i in range(req.max_new_tokens):
            time.sleep(self.delay)
            req.token_ids.append(ord("ab"[i % 2]))
            if req.first_token_at is None:
                req.first_token_at = time.perf_counter()
            if req.cancelled:
                req.finish_reason = "stop"
            elif len(req.token_ids) >= req.max_new_tokens:
                req.finish_reason = "length"
            req.on_token(req, req.token_ids[-1])
            if req.finish_reason:
                break
        req.done.set()


def serve(engine: FakeEngine | None = None, server_options: dict | None = None, **app_options) -> tuple[Server, App]:
    app = App("fake", FakeTokenizer(), **app_options)
    app.engine = engine or FakeEngine()
    app.ready.set()
    return Server(app, "127.0.0.1", 0, **(server_options or {})).start(), app


@pytest.fixture(scope="module")
def server():
    srv, app = serve()
    yield srv
    srv.close()


def exchange(port: int, data: bytes, timeout: float = 10.0, close_write: bool = False) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionError):
                break
            if not chunk:
                break
            got += chunk
            if _complete(got):
                break
        return got


def _complete(got: bytes) -> bool:
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def status_and_error(got: bytes) -> tuple[int, dict]:
    head, _, body = got.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers if headers is not None else {"Content-Length": len(body)}).items()]
    return exchange(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def completion_ok(port: int) -> bool:
    got = post(port, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    return got.startswith(b"HTTP/1.1 200") and b'"text": "ab"' in got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/nothing"])
@pytest.mark.parametrize("length,status,words", [
    ("-400000000", 400, "non-negative integer"),
    ("abc", 400, "non-negative integer"),
    ("+5", 400, "non-negative integer"),
    (str(MAX_BODY + 1), 413, "larger than"),
    (str(10 ** 30), 413, "larger than"),
])
def test_bad_content_length_is_a_4xx_on_every_path(server, path, length, status, words):
    got = post(server.port, path, b"{}", {"Content-Length": length})
    code, error = status_and_error(got)
    assert code == status and words in error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert completion_ok(server.port)


def test_post_without_length_is_411_and_chunked_is_refused(server):
    code, error = status_and_error(post(server.port, "/v1/completions", b"", {}))
    assert code == 411 and "Content-Length is required" in error["message"]
    chunked = b'2\r\n{}\r\n0\r\n\r\n'
    code, error = status_and_error(post(server.port, "/v1/completions", chunked, {"Transfer-Encoding": "chunked"}))
    assert code == 411 and "Transfer-Encoding" in error["message"]
    assert completion_ok(server.port)


def test_oversized_body_on_unknown_path_is_413_without_reading_it(server):
    got = post(server.port, "/v1/nothing", b"", {"Content-Length": str(MAX_BODY + 1)})
    assert status_and_error(got)[0] == 413


def test_get_with_a_body_is_bounded_too(server):
    got = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert status_and_error(got)[0] == 400
    got = exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert got.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("raw,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 400),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
])
def test_what_http_server_refuses_is_answered_in_openai_shape(server, raw, status):
    code, error = status_and_error(exchange(server.port, raw))
    assert code == status and error["message"]
    assert completion_ok(server.port)
