"""Fuzzing a real `shardwise serve` process (a tiny model, one rank) with hypothesis: request
bodies (JSON of OpenAI's fields with values of any type, and bytes that are not JSON) and raw HTTP
framing (request lines, headers, lengths, bodies). No answer is a 5xx, nothing reaches the
server's stderr as a traceback or an internal error, and a normal request is still answered
after. Bounded to about a minute: a fixed number of examples, each with a deadline."""
from __future__ import annotations

import json
import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .serve_process import serve_process
from .test_http_framing import exchange

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
          "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "suffix", "best_of",
          "logit_bias", "presence_penalty", "frequency_penalty", "tools", "response_format", "user"]
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
small_ints = st.integers(-2, 20)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]) | json_values,
     "content": st.text(max_size=30) | json_values}), max_size=3)
field_values = {
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=5) | json_values,
    "messages": messages | json_values,
    "max_tokens": small_ints | json_values, "n": small_ints | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=300), max_size=6) | json_values,
    "stream": st.booleans() | json_values, "logprobs": small_ints | st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
}
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({k: field_values.get(k, json_values) for k in d}))


@pytest.fixture(scope="module")
def served(tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--max-seq-len", "64", "--max-batch", "4",
            "--threads", "1"]
    with serve_process(args) as (base, lines):
        yield int(base.rsplit(":", 1)[1]), lines


def _status(got: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    return int(m.group(1)) if m else None


def _post(port: int, path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    return exchange(port, head.encode() + body, timeout=20)


def _clean(port: int, log: list[str]) -> None:
    text = "".join(log)      # the server's stderr so far
    assert "Traceback" not in text and "req-" not in text, text[-3000:]
    got = _post(port, "/v1/completions", b'{"prompt": "the quick", "max_tokens": 2}')
    assert _status(got) == 200, got


@SETTINGS
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_get_no_5xx(served, body, chat):
    port, _ = served
    got = _post(port, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    status = _status(got)
    assert status is not None and status < 500, got[:500]


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzzed_non_json_bodies_get_no_5xx(served, raw):
    port, _ = served
    status = _status(_post(port, "/v1/completions", raw))
    assert status is not None and status < 500


header_names = st.sampled_from(["Content-Length", "Transfer-Encoding", "Authorization", "Connection", "Expect",
                                "Host", "Content-Type"]) | st.text("abcXYZ-_:", min_size=0, max_size=10)
header_values = (st.sampled_from(["-1", "abc", "99999999999", "0", "5", "chunked", "close", "100-continue",
                                  " 12", "1e3", "+3"]) | st.text(max_size=20))
requests = st.tuples(
    st.sampled_from(["GET", "POST", "PUT", "HEAD", "OPTIONS", "DELETE", "BREW", ""]) | st.text(max_size=6),
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/x", "/healthz",
                     "/metrics", "/nope", "*", ""]) | st.text(max_size=20),
    st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "", "FOO"]),
    st.lists(st.tuples(header_names, header_values), max_size=5),
    st.binary(max_size=64))


@SETTINGS
@given(req=requests)
def test_fuzzed_framing_gets_no_5xx(served, req):
    port, _ = served
    method, path, version, headers, body = req
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    got = exchange(port, head.encode("utf-8", "surrogateescape") + body, timeout=15, close_write=True)
    status = _status(got)
    assert status is None or status < 500, got[:500]


def test_after_the_fuzz_nothing_was_logged_and_a_normal_request_is_answered(served):
    _clean(*served)
