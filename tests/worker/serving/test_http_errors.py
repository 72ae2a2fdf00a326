"""Errors of the HTTP API name nothing of the server's insides (worker/serving/http/errors.py,
framing.py), no ranks: JSON nested beyond MAX_JSON_DEPTH is a 400 (not the parser's 500), and a
500 carries a fixed sentence and a request id while the exception goes to the server's log."""
from __future__ import annotations

import json

import pytest

from shardwise.worker.serving.http.framing import MAX_JSON_DEPTH

from .test_http_framing import FakeEngine, completion_ok, post, serve, status_and_error


class _BrokenEngine(FakeEngine):
    def check(self, req, sequences: int = 1) -> None:
        raise RuntimeError("secret at /opt/shardwise/internal.py:42")


@pytest.fixture(scope="module")
def server():
    srv, _ = serve()
    yield srv
    srv.close()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000, 200000])
def test_deeply_nested_json_is_a_400(server, depth):
    body = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    code, error = status_and_error(post(server.port, "/v1/completions", body))
    assert code == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert completion_ok(server.port)


def test_nesting_up_to_the_limit_is_served(server):
    body = json.dumps({"prompt": "x", "max_tokens": 2, "user": [[[[1]]]]}).encode()
    assert post(server.port, "/v1/completions", body).startswith(b"HTTP/1.1 200")


def test_a_500_names_no_internals_and_the_log_has_them(capsys):
    srv, _ = serve(_BrokenEngine())
    try:
        code, error = status_and_error(post(srv.port, "/v1/completions", b'{"prompt": "x"}'))
    finally:
        srv.close()
    assert code == 500 and error["type"] == "server_error"
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    rid = error["message"].split("request id ")[1].split(")")[0]
    log = capsys.readouterr().err
    assert rid in log and "secret at /opt/shardwise/internal.py:42" in log
