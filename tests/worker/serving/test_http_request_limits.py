"""What one request may ask of the engine (worker/serving/http/app.py, protocol.py), no ranks:
n x max_tokens is bounded for requests of several choices (a single choice may still fill the
context), and stop strings are bounded in count (4, OpenAI's bound) and length (256 characters),
each refusal a 400 naming the limit."""
from __future__ import annotations

import pytest

from shardwise.worker.serving.http.app import App
from shardwise.worker.serving.http.errors import BadRequest

from .test_http_framing import FakeEngine, FakeTokenizer


class _LongContext(FakeEngine):
    max_seq = 131072


@pytest.fixture
def app() -> App:
    app = App("fake", FakeTokenizer(), max_request_tokens=1000)
    app.engine = _LongContext()
    return app


def _refused(app: App, body: dict, chat: bool = False) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        app.build_request(body, chat=chat)
    assert e.value.status == 400
    return e.value


def test_n_times_max_tokens_is_bounded(app):
    e = _refused(app, {"prompt": "x", "n": 3, "max_tokens": 400})
    assert e.param == "n" and "at most 1000 tokens" in str(e) and "1200" in str(e)
    assert len(app.build_request({"prompt": "x", "n": 2, "max_tokens": 500}, chat=False).reqs) == 2


def test_chat_default_max_tokens_with_n_is_bounded_but_one_choice_fills_the_context(app):
    msgs = [{"role": "user", "content": "hi"}]
    e = _refused(app, {"messages": msgs, "n": 16}, chat=True)
    assert "--max-request-tokens" in str(e)
    job = app.build_request({"messages": msgs}, chat=True)
    assert job.reqs[0].max_new_tokens > 100000


def test_default_bound_is_sane():
    app = App("fake", FakeTokenizer())
    app.engine = _LongContext()
    _refused(app, {"messages": [{"role": "user", "content": "hi"}], "n": 16}, chat=True)


@pytest.mark.parametrize("stop,words", [
    (["a", "b", "c", "d", "e"], "at most 4 strings"),
    (["x" * 257], "at most 256 characters"),
    ("x" * 1000, "at most 256 characters"),
])
def test_stop_strings_are_bounded(app, stop, words):
    e = _refused(app, {"prompt": "x", "stop": stop})
    assert e.param == "stop" and words in str(e)


def test_stop_strings_within_the_bounds_are_taken(app):
    job = app.build_request({"prompt": "x", "stop": ["a", "b", "c", "x" * 256]}, chat=False)
    assert job.stop == ["a", "b", "c", "x" * 256]
