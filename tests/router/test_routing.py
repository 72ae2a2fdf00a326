"""The router's pure parts: prefix hashes and the bounded index, the choice of a replica, per-key
token buckets, replica addresses, and the stream state that a migration continues from."""
from __future__ import annotations

import json

import pytest

from shardwise.operator.router.limits import Buckets, RateLimit, Unit
from shardwise.operator.router.migration import Event, StreamState, migratable
from shardwise.operator.router.replicas import parse_addresses, reported_load
from shardwise.operator.router.routing import (BLOCK_CHARS, BLOCKS_PER_REQUEST, Policy, PrefixIndex, Replica,
                                               block_hashes, choose, prompt_text)

SYSTEM = "You are a careful assistant. " * 20       # 560 characters: 8 blocks


def test_hashes_chain_so_that_one_hash_names_a_whole_prefix():
    a, b = block_hashes(SYSTEM + "question one"), block_hashes(SYSTEM + "another question")
    assert len(a) == len(SYSTEM + "question one") // BLOCK_CHARS
    shared = len(SYSTEM) // BLOCK_CHARS
    assert a[:shared] == b[:shared]
    # the same block after a different prefix hashes differently
    assert block_hashes("x" * BLOCK_CHARS + "y" * BLOCK_CHARS)[1] != block_hashes("z" * BLOCK_CHARS + "y" * BLOCK_CHARS)[1]
    assert len(block_hashes("a" * 10**6)) == 512        # bounded work per prompt


def test_the_index_is_bounded_and_forgets_the_least_recently_used():
    idx = PrefixIndex(capacity=10)
    first, second = block_hashes("a" * 8 * BLOCK_CHARS), block_hashes("b" * 8 * BLOCK_CHARS)
    idx.add(first)
    idx.add(second)
    assert len(idx) == 10
    assert idx.matched(second) == 8 and idx.matched(first) == 0      # its first blocks went first


def test_prefix_choice_prefers_the_replica_holding_the_prompt_unless_it_is_much_busier():
    a, b = Replica("http://a", ready=True), Replica("http://b", ready=True)
    hashes = block_hashes(SYSTEM + "what is two and two")
    b.index.add(hashes)
    assert choose([a, b], hashes) is b
    assert len(hashes) == 9
    b.running = 1                   # 8 blocks cached are worth one request of load: 9 blocks still win
    assert choose([a, b], hashes) is b
    b.waiting = 1                   # two requests of load outweigh them
    assert choose([a, b], hashes) is a
    b.running, b.waiting = 0, 0
    b.ready = False                 # never a replica that is not Ready
    assert choose([a, b], hashes) is a
    a.ready = False
    assert choose([a, b], hashes) is None
    assert BLOCKS_PER_REQUEST == 8


def test_equal_replicas_share_the_load_and_round_robin_takes_turns():
    rs = [Replica(f"http://r{i}", ready=True) for i in range(3)]
    assert {choose(rs, [], Policy.PREFIX, turn).address for turn in range(3)} == {r.address for r in rs}
    assert [choose(rs, [], Policy.ROUND_ROBIN, t).address for t in range(4)] == ["http://r0", "http://r1", "http://r2", "http://r0"]


def test_prompt_text_of_completions_and_chat():
    assert prompt_text({"prompt": ["hello"]}, chat=False) == "hello"
    assert prompt_text({"prompt": 7}, chat=False) == ""
    chat = prompt_text({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True)
    assert chat == "<system>be brief<user>hi"
    assert prompt_text({"messages": ["nonsense"]}, chat=True) == ""


def test_rate_limits_parse_and_refill():
    assert RateLimit.parse("5/s") == RateLimit(5.0, 5.0, Unit.REQUESTS)
    assert RateLimit.parse("100/s:400:tokens") == RateLimit(100.0, 400.0, Unit.TOKENS)
    for bad in ("5", "0/s", "5/s:0", "5/s:1:bytes", "x/s", "5/s:1:tokens:9"):
        with pytest.raises(ValueError, match="--rate-limit"):
            RateLimit.parse(bad)
    b = Buckets(RateLimit(2.0, 2.0, Unit.REQUESTS))
    assert b.take(0, 0.0) == 0 and b.take(0, 0.0) == 0
    assert b.take(0, 0.0) == pytest.approx(0.5)          # empty: one unit comes back in 1/rate s
    assert b.take(1, 0.0) == 0                           # another key has its own bucket
    assert b.take(0, 0.5) == 0
    t = Buckets(RateLimit(10.0, 20.0, Unit.TOKENS))
    assert t.take(0, 0.0) == 0
    t.charge(0, 50, 0.0)                                 # 20 - 50: a debt of 30 tokens
    assert t.take(0, 0.0) == pytest.approx(3.0, rel=1e-6)


def test_a_replica_s_reported_load_counts_and_absurd_reports_do_not():
    assert reported_load(b'{"status": "ok", "running": 3, "waiting": 5}') == (3, 5)
    assert reported_load(b'{"running": -1, "waiting": true}') == (0, 0)
    assert reported_load(b'{"running": 10000000000}') == (0, 0) and reported_load(b"<html>") == (0, 0)
    r = Replica("http://a", running=2, reported_running=5, waiting=1)
    assert r.load == 6          # the replica's own count covers other routers' requests


def test_replica_addresses():
    assert parse_addresses("10.0.0.1:8000, http://b:9/ \n# comment\nhttp://b:9") == ["http://10.0.0.1:8000", "http://b:9"]
    for bad in ("ftp://x", "http://x/path", "http://:80", "http://x:99999"):
        with pytest.raises(ValueError, match="expected http://host:port"):
            parse_addresses(bad)


def _chunk(text, ids=None, finish=None, **top):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": [c], **top}).encode()


def test_a_completion_continues_from_its_settled_tokens_and_skips_what_the_client_saw():
    body = {"prompt": "p", "max_tokens": 10, "stream": True, "temperature": 0, "stop": ["zz"]}
    assert migratable(body) and not migratable({**body, "n": 2}) and not migratable({**body, "stream": False})
    s = StreamState.of(body, chat=False)
    ev, out = s.feed(_chunk("ab", [1, 2], prompt_token_ids=[7, 8], max_tokens=10))
    out = json.loads(out)
    assert ev == Event.CHUNK and out["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}
    assert "prompt_token_ids" not in out            # the client did not ask for ids
    ev, out = s.feed(_chunk("\"token_ids\": [5]", []))    # the hot path: a text that spells a field
    assert json.loads(out)["choices"][0]["text"] == '"token_ids": [5]' and s.generated == [1, 2]
    ev, out = s.feed(_chunk("e", [3]))
    assert s.generated == [1, 2, 3] and "token_ids" not in json.loads(out)["choices"][0]
    s.feed(_chunk("c"))                             # text of a token not settled yet (held back)
    cont = s.continuation(body)
    assert cont == {"prompt": [7, 8, 1, 2, 3], "max_tokens": 7, "stream": True, "return_token_ids": True,
                    "temperature": 0, "stop": ["zz"]}
    s.moved()
    ev, out = s.feed(_chunk("cd", [4, 5], id="other", prompt_token_ids=[7, 8, 1, 2, 3], max_tokens=7))
    out = json.loads(out)
    assert out["choices"][0]["text"] == "d" and out["id"] == "cmpl-1"       # "c" was seen already
    ev, out = s.feed(_chunk("", [], finish="length"))
    assert s.finished and s.continuation(body) is None and s.feed(b"[DONE]")[0] == Event.DONE
    assert s.feed(b'{"error": {"message": "x"}}')[0] == Event.FAILED and s.feed(b"{not json")[0] == Event.FAILED


def test_a_chat_stream_continues_through_completions_as_chat_deltas():
    s = StreamState.of({"stream": True}, chat=True)
    role = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [5, 6],
            "max_tokens": 4, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    s.feed(json.dumps(role).encode())
    s.feed(json.dumps({**role, "choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [9]}]}).encode())
    assert s.continuation({"messages": [], "stream": True})["prompt"] == [5, 6, 9]
    s.moved()
    ev, out = s.feed(_chunk(" there", [10]))
    out = json.loads(out)
    assert out["object"] == "chat.completion.chunk" and out["choices"][0]["delta"] == {"content": " there"}
    ev, out = s.feed(_chunk("", [11], finish="length"))
    out = json.loads(out)
    assert out["choices"][0]["delta"] == {} and out["choices"][0]["finish_reason"] == "length"
    assert s.generated == [9, 10, 11]


def test_a_stream_moved_twice_gives_each_character_once():
    body = {"prompt": "p", "max_tokens": 10, "stream": True}
    s = StreamState.of(body, chat=False)
    seen = []

    def feed(*args, **kw):
        ev, out = s.feed(_chunk(*args, **kw))
        seen.append(json.loads(out)["choices"][0]["text"] if ev == Event.CHUNK else "")
    feed("ab", [1, 2], prompt_token_ids=[7], max_tokens=10)
    feed("cd")                                  # seen, not settled
    s.moved()
    assert s.continuation(body)["prompt"] == [7, 1, 2]
    feed("c", [3])                              # settles "c"; "d" was seen beyond it
    s.moved()
    assert s.continuation(body)["prompt"] == [7, 1, 2, 3] and s.skip == 1
    feed("d", [4])
    feed("e", [5])
    assert "".join(seen) == "abcde" and s.generated == [1, 2, 3, 4, 5]
