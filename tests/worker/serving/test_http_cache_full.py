"""A request that outgrows the whole KV cache alone ends with finish_reason "length" and its answer,
plain and streamed: the engine ends it without a token that carries its end, and the HTTP side must
still hear of it (it reads tokens off a queue, off the engine thread)."""
from __future__ import annotations

import json
import shutil
import threading
import urllib.request
from pathlib import Path

import pytest

from shardwise.worker.serving.http.server import App, Server, run_engine
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.weights.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def no_eos_model(tiny_serving_model, tmp_path_factory) -> Path:
    """The tiny model with no end-of-sequence token: a random model's greedy text may reach its EOS
    within 32 tokens (and near-tied logits make whether it does vary with the machine's threading),
    which would end the request with "stop" before it ever outgrows the cache."""
    folder = tmp_path_factory.mktemp("no-eos") / "tiny"
    shutil.copytree(tiny_serving_model, folder)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("eos_token_id", None)
            path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def base(no_eos_model):
    # 32 cached tokens (two blocks of 16) for a context of 128: one request outgrows the cache
    spec = RankSpec(str(no_eos_model), max_batch=2, max_seq=128, kv_tokens=32)
    runtime = LocalRuntime(spec)
    app = App("tiny", load_tokenizer(runtime.source))
    server = Server(app, "127.0.0.1", 0).start()
    ctx = runtime.start()
    stop = threading.Event()
    loop = threading.Thread(target=run_engine, args=(app, ctx, stop), daemon=True)
    loop.start()
    assert app.ready.wait(60)
    yield f"http://127.0.0.1:{server.port}"
    stop.set()
    loop.join(30)
    runtime.stop()
    server.close()


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:    # a hang fails here instead of stalling
        assert r.status == 200
        return r.read()


def test_a_request_that_outgrows_the_cache_ends_with_length(base):
    body = {"prompt": "the quick brown fox", "max_tokens": 100}
    answer = json.loads(_post(base + "/v1/completions", body))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert 0 < answer["usage"]["completion_tokens"] < 100
    # every token but the last sampled one holds a cache position
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= 32 + 1


def test_its_stream_ends_too(base):
    raw = _post(base + "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 100, "stream": True})
    events = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
    assert reasons[-1] == "length"
