"""`ignore_eos` (vLLM's and llama.cpp's extension) on a real `shardwise serve` of the built-in
SmolLM2: a short chat answer that ends on the model's end-of-turn token goes on to max_tokens when
the request asks for it, with the same text first; a load test then gets the answer lengths it asked
for. Skipped without the SmolLM2 weights."""
from __future__ import annotations

import json
import urllib.request

import pytest

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.loader import open_model

from .serve_process import serve_process

try:
    open_model("smollm2")
except WorkerError as e:  # the demo model is an optional download
    pytest.skip(str(e), allow_module_level=True)

MAX_TOKENS = 24


def _chat(base: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "Answer with one word: is the sky blue?"}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_ignore_eos_generates_max_tokens_past_the_end_of_the_answer():
    with serve_process(["--model", "smollm2", "--port", "0", "--max-batch", "2", "--threads", "1"]) as (base, _):
        plain, forced = _chat(base), _chat(base, ignore_eos=True)
    short, long = plain["choices"][0], forced["choices"][0]
    assert short["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < MAX_TOKENS, plain
    assert long["finish_reason"] == "length" and forced["usage"]["completion_tokens"] == MAX_TOKENS, forced
    assert long["message"]["content"].startswith(short["message"]["content"].strip()), (short, long)
