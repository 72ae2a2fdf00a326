"""The router in front of real `shardwise serve` replicas on loopback (the tiny model): greedy
answers through it equal a replica's own; a replica killed (SIGKILL) under several concurrent
streams loses none of them; requests are held while no replica is Ready and served when one comes
back, or answered 503 with Retry-After past the bound; API keys and per-key rate limits; requests
sharing a long system prompt go to the replica that holds it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from shardwise.worker.serving.rank import free_port

from .processes import (metric, post, replica_args, router_process, serve_process, stream, wait_until)

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant who answers briefly and only from the facts given. " * 6


@pytest.fixture(scope="module")
def pair(tiny_serving_model):
    """Two replicas, the same model."""
    with serve_process(replica_args(tiny_serving_model)) as (a, _), \
            serve_process(replica_args(tiny_serving_model)) as (b, _):
        yield a, b


def _chat(question: str, max_tokens: int = 4, system: str = SYSTEM) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}


def test_greedy_answers_through_the_router_equal_a_replica_s_own(pair, tiny_serving_model):
    a, b = pair
    with router_process(["--replicas", f"{a},{b}"]) as (router, _, _):
        body = {"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0}
        code, _, direct = post(a, "/v1/completions", body)
        code2, _, routed = post(router, "/v1/completions", body)
        assert code == code2 == 200 and routed["choices"][0]["text"] == direct["choices"][0]["text"]
        assert stream(router, "/v1/completions", body) == (direct["choices"][0]["text"], "done")
        chat = _chat("what jumps?", 40)
        assert stream(router, "/v1/chat/completions", chat) == stream(b, "/v1/chat/completions", chat)
        with urllib.request.urlopen(router + "/v1/models", timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [str(tiny_serving_model)]


def test_a_replica_killed_mid_stream_loses_no_stream(tiny_serving_model, pair):
    """Four concurrent streams (two completions, two chats) spread over two replicas; one replica
    is SIGKILLed once every stream has given text: each stream ends with [DONE] and exactly the
    text of an undisturbed greedy run, and the router counts its migrations."""
    _, survivor = pair
    bodies = [("/v1/completions", {"prompt": f"the quick brown fox {i} jumps", "max_tokens": 600, "temperature": 0})
              for i in range(2)]
    bodies += [("/v1/chat/completions", _chat(f"a lazy dog {i}", 600, system="be brief")) for i in range(2)]
    undisturbed = [stream(survivor, path, body)[0] for path, body in bodies]
    port = free_port()
    with serve_process(replica_args(tiny_serving_model, port)) as (victim, _):
        proc_pid = _pid_listening(port)
        with router_process(["--replicas", f"{victim},{survivor}", "--policy", "round-robin"]) as (router, _, _):
            started = [threading.Event() for _ in bodies]
            results: list = [None] * len(bodies)
            stalls: list[list[float]] = []

            def run(i, path, body):
                results[i] = stream(router, path, body, on_chunk=lambda n: n >= 5 and started[i].set(),
                                    stalls=stalls)
            threads = [threading.Thread(target=run, args=(i, p, b)) for i, (p, b) in enumerate(bodies)]
            for t in threads:
                t.start()
            for e in started:
                assert e.wait(60)
            os.kill(proc_pid, signal.SIGKILL)
            for t in threads:
                t.join(120)
            assert [r[1] for r in results] == ["done"] * len(bodies)
            assert [r[0] for r in results] == undisturbed
            assert metric(router, "shardwise_router_migrations_total")[""] >= 1
            print(f"longest stall of a stream: {max(x[0] for x in stalls) * 1e3:.0f} ms")


def _pid_listening(port: int) -> int:
    """The pid of the `shardwise serve` started with --port `port` (this test's own process)."""
    out = subprocess.check_output(["pgrep", "-f", f"shardwise serve .*--port {port} "], text=True)
    return int(out.split()[0])


def test_requests_are_held_until_a_replica_is_ready_then_503_past_the_bound(tiny_serving_model):
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    with router_process(["--replicas", dead, "--hold-seconds", "1"]) as (router, _, _):
        t0 = time.monotonic()
        code, headers, body = post(router, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 503 and int(headers["Retry-After"]) >= 1 and body["error"]["code"] == "no_replica_ready"
        assert 0.9 < time.monotonic() - t0 < 10
        _bounds(router)
    with router_process(["--replicas", f"http://127.0.0.1:{port}", "--hold-seconds", "180"]) as (router, _, _):
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(
            stream(router, "/v1/completions", {"prompt": "the quick", "max_tokens": 8, "temperature": 0}, timeout=200)))
        waiting.start()
        wait_until(lambda: metric(router, "shardwise_router_holds_total").get("", 0) >= 1)
        with serve_process(replica_args(tiny_serving_model, port)) as (replica, _):
            waiting.join(200)
            assert got and got[0][1] == "done" and got[0][0]
            assert got[0][0] == stream(replica, "/v1/completions", {"prompt": "the quick", "max_tokens": 8,
                                                                   "temperature": 0})[0]


def test_api_keys_and_per_key_rate_limits(pair, tmp_path):
    a, b = pair
    keys = tmp_path / "keys"
    keys.write_text("sk-router-one\nsk-router-two\n")
    body = {"prompt": "the quick", "max_tokens": 2}
    with router_process(["--replicas", f"{a},{b}", "--api-key-file", str(keys), "--rate-limit", "0.2/s:2"]) as (
            router, lines, _):
        code, headers, err = post(router, "/v1/completions", body, key="sk-wrong")
        assert code == 401 and err["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
        assert post(router, "/v1/completions", body)[0] == 401
        assert [post(router, "/v1/completions", body, key="sk-router-one")[0] for _ in range(2)] == [200, 200]
        code, headers, err = post(router, "/v1/completions", body, key="sk-router-one")
        assert code == 429 and err["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(headers["Retry-After"]) <= 5
        assert post(router, "/v1/completions", body, key="sk-router-two")[0] == 200     # its own bucket
        assert not any("sk-router" in line for line in lines)


@pytest.mark.parametrize("policy", ["prefix", "round-robin"])
def test_requests_sharing_a_system_prompt_go_to_the_replica_that_holds_it(pair, policy):
    a, b = pair
    system = f"{policy}: " + SYSTEM      # a prompt neither replica has cached yet
    with router_process(["--replicas", f"{a},{b}", "--policy", policy]) as (router, _, _):
        cached = []
        for i in range(6):
            code, _, answer = post(router, "/v1/chat/completions", _chat(f"question {i}", 2, system))
            assert code == 200
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        routed = metric(router, "shardwise_router_routed_total")
    if policy == "prefix":
        assert sorted(routed.values()) == [6.0] and all(c > 0 for c in cached[1:])
    else:
        assert sorted(routed.values()) == [3.0, 3.0] and cached[1] == 0


def test_replicas_from_a_file_that_changes(pair, tmp_path):
    """A replicas file re-read when it changes: requests held while it names no live replica are
    served once it names one; a stream of several choices goes through as is."""
    a, _ = pair
    listing = tmp_path / "replicas"
    listing.write_text(f"http://127.0.0.1:{free_port()}\n")
    with router_process(["--replicas-file", str(listing), "--hold-seconds", "60"]) as (router, _, _):
        got: list = []
        body = {"prompt": "the quick", "max_tokens": 6, "temperature": 0}
        waiting = threading.Thread(target=lambda: got.append(post(router, "/v1/completions", body)))
        waiting.start()
        wait_until(lambda: metric(router, "shardwise_router_holds_total").get("", 0) >= 1)
        # what the operator's autoscaler reads to wake a model scaled to zero
        assert metric(router, "shardwise_router_held_requests")[""] == 1
        listing.write_text(f"# rendered by the operator\n{a}\n")
        waiting.join(60)
        assert metric(router, "shardwise_router_held_requests")[""] == 0
        assert got[0][0] == 200 and got[0][2]["choices"][0]["text"] == post(a, "/v1/completions", body)[2]["choices"][0]["text"]
        text, end = stream(router, "/v1/completions", {**body, "n": 2})
        assert end == "done" and text


def test_a_replica_gives_the_settled_token_ids_a_continuation_needs(pair):
    """return_token_ids (the worker's side of migration): the first chunk has the prompt's ids and
    the completion bound, the chunks' ids are every generated token, and continuing from a prefix
    of them gives the rest of the same greedy text."""
    import urllib.request as ur
    a, _ = pair
    body = {"prompt": "the quick brown fox", "max_tokens": 30, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    req = ur.Request(a + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    chunks = []
    with ur.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["max_tokens"] == 30 and chunks[0]["prompt_token_ids"]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert len(ids) == chunks[-1]["usage"]["completion_tokens"] == 30
    assert len(chunks[0]["prompt_token_ids"]) == chunks[-1]["usage"]["prompt_tokens"]
    whole = "".join(ch["text"] for c in chunks for ch in c["choices"])
    code, _, rest = post(a, "/v1/completions", {"prompt": chunks[0]["prompt_token_ids"] + ids[:10],
                                                 "max_tokens": 20, "temperature": 0})
    assert whole.endswith(rest["choices"][0]["text"]) and len(rest["choices"][0]["text"]) > 0


def _bounds(router: str) -> None:
    """What the router refuses before any replica is asked: bodies over 4 MiB, bodies that are not
    a JSON object, more than 64 headers; each one line of OpenAI's error shape."""
    import urllib.error
    import urllib.request as ur

    def send(data: bytes, headers: dict | None = None) -> tuple[int, bytes]:
        req = ur.Request(router + "/v1/completions", data=data, headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with ur.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    code, body = send(b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    assert code == 413
    code, body = send(b"[1, 2]")
    assert code == 400 and json.loads(body)["error"]["message"] == "the request body must be a JSON object"
    code, _ = send(b"{}", {f"X-H{i}": "1" for i in range(80)})
    assert code == 400
