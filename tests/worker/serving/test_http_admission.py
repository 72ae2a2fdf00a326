"""Admission of a real `shardwise serve` (worker/serving/scheduler.py's bounded queue, the HTTP
API's 429): a burst beyond --max-waiting is refused at once with 429, Retry-After and OpenAI's
error shape while the admitted requests complete; requests whose clients went away leave the
queue at once, wherever they stand in it, so that they neither hold a place nor delay anyone; and
a crowd of abandoned full-context requests leaves the engine idle within a second, a normal
request served promptly. The tiny model decodes about a token a millisecond: a 1,000-token request
holds the engine's one row for over a second."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .serve_process import serve_process

MAX_WAITING = 6
LONG = {"prompt": "the quick", "max_tokens": 1000, "temperature": 0}     # greedy: never an end token


@pytest.fixture(scope="module")
def served(tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--max-seq-len", "1024", "--max-batch", "1",
            "--threads", "1", "--max-waiting", str(MAX_WAITING)]
    with serve_process(args) as (base, lines):
        yield base, lines


def _post(base: str, body: dict, path: str = "/v1/completions") -> tuple[int, dict, dict, float]:
    """Status, headers, JSON body and seconds taken."""
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read()), time.monotonic() - t0


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _until(base: str, seconds: float, ok) -> dict[str, float]:
    """/metrics once `ok(metrics)` holds, or the last one read after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        m = _metrics(base)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _idle(m: dict[str, float]) -> bool:
    return m["shardwise_running_requests"] == 0 and m["shardwise_waiting_requests"] == 0


def _abandon(base: str, count: int) -> list[socket.socket]:
    """Chat requests without max_tokens (each the rest of the context), sent and never read."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"messages": [{"role": "user", "content": "the lazy dog"}], "temperature": 0}).encode()
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(raw)
        socks.append(s)
    return socks


def _in_background(base: str, body: dict, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(_post(base, body)), daemon=True)
    t.start()
    return t


def test_a_burst_beyond_the_queue_gets_429_at_once_and_the_admitted_requests_complete(served):
    base, lines = served
    assert _idle(_until(base, 30, _idle))
    before = _metrics(base).get("shardwise_rejected_requests_total", 0)
    burst = 16
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda _: _post(base, LONG), range(burst)))
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(ok) + len(refused) == burst, [a[0] for a in answers]
    # one row and MAX_WAITING places: the rest are refused, none is lost
    assert MAX_WAITING <= len(ok) <= MAX_WAITING + 2 and refused
    assert all(a[2]["usage"]["completion_tokens"] == 1000 for a in ok)
    for status, headers, body, _ in refused:
        assert int(headers["Retry-After"]) >= 1
        err = body["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "invalid_request_error"
        assert "--max-waiting" in err["message"] and "\n" not in err["message"]
    # refused at once, not after waiting in the queue: before the first admitted one has finished
    assert max(a[3] for a in refused) < min(a[3] for a in ok)
    m = _until(base, 30, _idle)
    assert m["shardwise_rejected_requests_total"] - before == len(refused)
    assert m["shardwise_max_waiting_requests"] == MAX_WAITING
    assert m['shardwise_requests_total{code="429",endpoint="/v1/completions"}'] >= len(refused)
    # a request of n choices takes n places: more than the whole queue can never be admitted
    status, _, body, _ = _post(base, {"prompt": "the", "max_tokens": 2, "n": MAX_WAITING + 1})
    assert status == 400 and "--max-waiting" in body["error"]["message"]
    assert not any("Traceback" in line for line in lines)


def test_abandoned_requests_leave_the_queue_at_once_and_hold_no_place(served):
    base, lines = served
    assert _idle(_until(base, 30, _idle))
    live: list = []
    threads = [_in_background(base, LONG, live)]          # the row, for over a second
    assert _until(base, 10, lambda m: m["shardwise_running_requests"] == 1)["shardwise_running_requests"] == 1
    threads += [_in_background(base, LONG, live) for _ in range(3)]      # three live ones queued first
    assert _until(base, 10, lambda m: m["shardwise_waiting_requests"] == 3)["shardwise_waiting_requests"] == 3
    gone = _abandon(base, MAX_WAITING - 3)                  # the queue full behind them
    assert _until(base, 10, lambda m: m["shardwise_waiting_requests"] == MAX_WAITING
                  )["shardwise_waiting_requests"] == MAX_WAITING
    for s in gone:
        s.close()
    # the live ones are still ahead of them, for seconds: the abandoned ones leave now all the same
    m = _until(base, 1.0, lambda m: m["shardwise_waiting_requests"] <= 3)
    assert m["shardwise_waiting_requests"] <= 3 and m["shardwise_running_requests"] == 1
    # and hold no place: a new request is admitted, not refused
    status, _, body, _ = _post(base, {"prompt": "the", "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    for t in threads:
        t.join(60)
    assert [a[0] for a in live] == [200] * 4
    assert not any("Traceback" in line for line in lines)


def test_a_crowd_of_abandoned_full_context_requests_frees_the_engine_within_a_second(served):
    base, lines = served
    assert _idle(_until(base, 30, _idle))
    t0 = time.monotonic()
    _post(base, {"prompt": "the", "max_tokens": 8, "temperature": 0})
    usual = time.monotonic() - t0
    gone = _abandon(base, 1)                                # the row ...
    assert _until(base, 10, lambda m: m["shardwise_running_requests"] == 1)["shardwise_running_requests"] == 1
    gone += _abandon(base, MAX_WAITING)                     # ... and the whole queue
    full = _until(base, 10, lambda m: m["shardwise_waiting_requests"] == MAX_WAITING)
    assert full["shardwise_running_requests"] == 1 and full["shardwise_waiting_requests"] == MAX_WAITING
    for s in gone:
        s.close()
    t0 = time.monotonic()
    assert _idle(_until(base, 1.5, _idle)), "abandoned requests still hold the engine"
    freed = time.monotonic() - t0
    status, _, body, took = _post(base, {"prompt": "the", "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    assert took < max(1.0, 5 * usual), (took, usual, freed)
    assert not any("Traceback" in line for line in lines)
