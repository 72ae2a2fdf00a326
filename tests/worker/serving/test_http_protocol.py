"""Request bodies (worker/serving/http/protocol.py, app.py), no ranks: each invalid body gets the
message, status, param and code it always got (pydantic's own wording never reaches the caller),
the first problem in the order a caller is told (model, refused parameters, prompt or messages,
its tokenization, the options, the context), and a valid body becomes the engine requests."""
from __future__ import annotations

import pytest

from shardwise.worker.serving.http.app import App
from shardwise.worker.serving.http.errors import BadRequest


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text)))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if any(m["content"] == "boom" for m in messages):
            raise ValueError("bad")
        return "".join(f"{m['role']}:{m['content']};" for m in messages)


class _Engine:
    max_seq = 64

    class stage:
        vocab_size = 50

    def check(self, req, sequences: int = 1) -> None:
        pass


@pytest.fixture
def app() -> App:
    app = App("tiny", _Tokenizer())
    app.engine = _Engine()
    return app


CASES = [
    (False, [1, 2], (400, 'request body must be a JSON object', None, None)),
    (False, {}, (400, "'prompt' must be a string or a non-empty list of token ids", 'prompt', None)),
    (False, {'prompt': 'x', 'model': 5}, (400, "'model' must be a string", 'model', None)),
    (False, {'prompt': 'x', 'model': 'gpt-4o', 'echo': True},
     (404, "The model 'gpt-4o' does not exist; this server serves 'tiny'", 'model', 'model_not_found')),
    (False, {'prompt': 'x', 'echo': True, 'best_of': 2},
     (400, "'echo' is not supported by this server (leave it out)", 'echo', None)),
    (False, {'prompt': ['a', 'b']},
     (400, "'prompt' must be a string or a non-empty list of token ids", 'prompt', None)),
    (False, {'prompt': [1, 50]}, (400, 'prompt token ids must be in [0, 50)', 'prompt', None)),
    (False, {'prompt': [1, True]}, (400, "'prompt' must be a string or a non-empty list of token ids", 'prompt', None)),
    (False, {'prompt': 'x', 'max_tokens': 0}, (400, "'max_tokens' must be a positive integer", 'max_tokens', None)),
    (False, {'prompt': 'x', 'max_tokens': 'x', 'max_completion_tokens': 1.5},
     (400, "'max_completion_tokens' must be a positive integer", 'max_completion_tokens', None)),
    (False, {'prompt': 'x', 'temperature': True},
     (400, "'temperature' must be a number in [0, 2]", 'temperature', None)),
    (False, {'prompt': 'x', 'temperature': 2.5, 'top_p': 0},
     (400, "'temperature' must be a number in [0, 2]", 'temperature', None)),
    (False, {'prompt': 'x', 'top_p': 0}, (400, "'top_p' must be a number in (0, 1]", 'top_p', None)),
    (False, {'prompt': 'x', 'n': 17}, (400, "'n' must be an integer from 1 to 16", 'n', None)),
    (False, {'prompt': 'x', 'seed': 18446744073709551614, 'n': 3},
     (400, "'seed' must be an integer in [-2^63, 2^64 - n]", 'seed', None)),
    (False, {'prompt': 'x', 'seed': 1.0}, (400, "'seed' must be an integer in [-2^63, 2^64 - n]", 'seed', None)),
    (False, {'prompt': 'x', 'stop': ['a', '']},
     (400, "'stop' must be a string or a list of non-empty strings", 'stop', None)),
    (False, {'prompt': 'x', 'stop': 5}, (400, "'stop' must be a string or a list of non-empty strings", 'stop', None)),
    (False, {'prompt': 'x', 'stream': 'yes'}, (400, "'stream' must be a boolean", 'stream', None)),
    (False, {'prompt': 'x', 'ignore_eos': 1}, (400, "'ignore_eos' must be a boolean", 'ignore_eos', None)),
    (False, {'prompt': 'x', 'stream_options': 5},
     (400, "'stream_options' is only allowed when 'stream' is true", 'stream_options', None)),
    (False, {'prompt': 'x', 'stream': True, 'stream_options': {'include_usage': 1}},
     (400, '\'stream_options\' must be an object like {"include_usage": true}', 'stream_options', None)),
    (False, {'prompt': 'x', 'logprobs': True}, (400, "'logprobs' must be an integer from 0 to 20", 'logprobs', None)),
    (False, {'prompt': 'x' * 64},
     (400, "This model's maximum context length is 64 tokens. However, the prompt is 64 tokens, which leaves no "
      'room for the completion. Please reduce the length of the prompt.', 'prompt', 'context_length_exceeded')),
    (False, {'prompt': 'xxxxxxxxxx', 'max_tokens': 60},
     (400, "This model's maximum context length is 64 tokens. However, you requested 70 tokens (10 in the "
      'prompt, 60 in the completion). Please reduce the length of the prompt or completion.',
      'max_tokens', 'context_length_exceeded')),
    (True, {'messages': 'hi'},
     (400, "'messages' must be a non-empty list of {role, content} objects", 'messages', None)),
    (True, {'messages': []}, (400, "'messages' must be a non-empty list of {role, content} objects", 'messages', None)),
    (True, {'messages': [{'role': 'user', 'content': 'x'}, 'y']},
     (400, "'messages[1]' must be an object with 'role' and 'content'", 'messages[1]', None)),
    (True, {'messages': [{'role': 'robot', 'content': 5}]},
     (400, "'messages[0].role' is 'robot'; valid roles are: system, developer, user, assistant, tool",
      'messages[0].role', None)),
    (True, {'messages': [{'content': 'x'}]},
     (400, "'messages[0].role' is None; valid roles are: system, developer, user, assistant, tool",
      'messages[0].role', None)),
    (True, {'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'image_url'}]}]},
     (400, '\'messages[0].content\' parts must be {"type": "text", "text": string}; only text is supported',
      'messages[0].content', None)),
    (True, {'messages': [{'role': 'user', 'content': None}]},
     (400, "'messages[0].content' must be a string or a list of text parts", 'messages[0].content', None)),
    (True, {'messages': [{'role': 'user', 'content': 'boom'}], 'n': 0},
     (400, 'chat template failed: ValueError: bad', 'messages', None)),
    (True, {'messages': [{'role': 'user', 'content': 'x'}], 'logprobs': 1},
     (400, "'logprobs' must be a boolean", 'logprobs', None)),
    (True, {'messages': [{'role': 'user', 'content': 'x'}], 'top_logprobs': 2},
     (400, "'top_logprobs' requires 'logprobs': true", 'top_logprobs', None)),
    (True, {'messages': [{'role': 'user', 'content': 'x'}], 'logprobs': True, 'top_logprobs': 21},
     (400, "'top_logprobs' must be an integer from 0 to 20", 'top_logprobs', None)),
    (True, {'messages': [{'role': 'user', 'content': 'x'}], 'max_completion_tokens': 64},
     (400, "This model's maximum context length is 64 tokens. However, you requested 71 tokens (7 in the "
      'messages, 64 in the completion). Please reduce the length of the messages or completion.',
      'max_completion_tokens', 'context_length_exceeded')),
]


@pytest.mark.parametrize("chat,body,error", CASES)
def test_an_invalid_body_gets_its_message(app, chat, body, error):
    with pytest.raises(BadRequest) as e:
        app.build_request(body, chat)
    assert (e.value.status, str(e.value), e.value.param, e.value.code) == error


def test_a_valid_body_becomes_n_engine_requests(app):
    job = app.build_request({"prompt": "abc", "n": 2, "seed": 5, "temperature": 1, "stop": "x", "logprobs": 3,
                             "stream": True, "stream_options": {"include_usage": True}, "user": "ignored"}, chat=False)
    assert [(r.prompt_ids, r.max_new_tokens, r.seed, r.logprobs) for r in job.reqs] == [([0, 1, 2], 16, 5, 3),
                                                                                      ([0, 1, 2], 16, 6, 3)]
    assert type(job.reqs[0].temperature) is float and job.reqs[0].top_p == 1.0
    assert not job.reqs[0].ignore_eos
    assert [r.ignore_eos for r in app.build_request({"prompt": "abc", "n": 2, "ignore_eos": True}, chat=False).reqs] \
        == [True, True]
    assert (job.stop, job.chat, job.stream, job.include_usage, job.logprobs) == (["x"], False, True, True, True)


def test_chat_messages_go_to_the_template_as_one_string_each(app):
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    job = app.build_request({"messages": messages, "logprobs": True}, chat=True)
    assert len(job.reqs[0].prompt_ids) == len("system:be brief;user:a\nb;")
    assert job.reqs[0].max_new_tokens == 64 - len(job.reqs[0].prompt_ids)    # chat: up to the context's end
    assert job.reqs[0].logprobs == 0 and job.stop == [] and not job.stream


def test_a_model_in_the_path_is_this_one_or_not_found(app):
    app.check_model("tiny")
    with pytest.raises(BadRequest) as e:
        app.check_model("")
    assert (e.value.status, e.value.code, str(e.value)) == (404, "model_not_found",
                                                             "The model '' does not exist; this server serves 'tiny'")
