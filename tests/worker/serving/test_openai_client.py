"""A real `shardwise serve` process (a tiny model, one rank) as the official `openai` client sees
it: completions and chat, plain and streamed; unknown models are NotFoundError; logprobs are the
log-probabilities of the distribution each token was drawn from; n choices with seeds; invalid
roles and over-long requests are BadRequestError naming the problem; include_usage; cached prompt
tokens in usage; /v1/models reports the context length."""
from __future__ import annotations

import math

import pytest
import torch

from shardwise.worker.weights.loader import open_model
from shardwise.worker.weights.tokenizer import load_tokenizer

from .serve_process import serve_process

openai = pytest.importorskip("openai")

CONTEXT = 128


@pytest.fixture(scope="module")
def served(tiny_serving_model):
    path = tiny_serving_model
    args = ["--model", str(path), "--port", "0", "--max-seq-len", str(CONTEXT), "--max-batch", "4", "--threads", "1"]
    with serve_process(args) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60), str(path)


@pytest.fixture(scope="module")
def reference(served):
    """The first next-token log-probabilities of a prompt, from transformers on the same weights."""
    from transformers import LlamaForCausalLM
    _, path = served
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(open_model(path))

    def logits(prompt: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([tok.encode(prompt)])).logits[0, -1]
    return logits


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_completions_and_chat_plain_and_streamed(served):
    client, model = served
    plain = client.completions.create(model=model, prompt="the quick brown", max_tokens=6, temperature=0)
    choice = plain.choices[0]
    assert plain.model == model and choice.finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens == 6 if choice.finish_reason == "length" else 0 < plain.usage.completion_tokens < 6
    streamed = client.completions.create(model=model, prompt="the quick brown", max_tokens=6, temperature=0,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)         # no include_usage: no usage anywhere

    chat = client.chat.completions.create(model=model, messages=_user("pack my box"), max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    deltas = list(client.chat.completions.create(model=model, messages=_user("pack my box"), max_tokens=5,
                                                 temperature=0, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content


def test_unknown_model_is_not_found_and_the_server_keeps_serving(served):
    client, model = served
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="the", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert e.value.body["type"] == "invalid_request_error" and "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=_user("hi"), max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert client.completions.create(model=model, prompt="the", max_tokens=2).choices


def test_completion_logprobs_are_the_greedy_distribution(served, reference):
    client, model = served
    prompt = "the lazy dog"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens - (choice.finish_reason == "stop")   # an end-of-text token is not text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-5
        best = next(iter(top))
        assert token == best and value == pytest.approx(top[best], abs=1e-6)   # greedy = the top-1
    # each token's text sits at its offset in the completion
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert choice.text[offset:offset + len(token)] == token
    # the values are transformers' log_softmax of the same weights' logits
    first = torch.log_softmax(reference(prompt), -1)
    assert lp.token_logprobs[0] == pytest.approx(first.max().item(), abs=1e-4)


def test_sampled_logprobs_are_after_temperature(served, reference):
    client, model = served
    prompt = "five dozen"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.5, seed=3, logprobs=3)
    lp = out.choices[0].logprobs
    expect = torch.log_softmax(reference(prompt) / 0.5, -1)
    top = list(lp.top_logprobs[0].values())
    assert top == pytest.approx(expect.topk(3).values.tolist(), abs=1e-4)
    assert lp.token_logprobs[0] <= top[0] <= 0


def test_chat_logprobs_plain_and_streamed_agree(served):
    client, model = served
    kw = dict(model=model, messages=_user("the quick brown fox"), max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3)
    plain = client.chat.completions.create(**kw)
    content = plain.choices[0].logprobs.content
    assert content and len(content) <= plain.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    text = bytes(b for entry in content for b in entry.bytes).decode("utf-8", "replace")
    assert text == plain.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(**kw, stream=True)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**kw, "top_logprobs": 21})


def test_n_choices_with_a_seed_are_distinct_and_reproducible(served):
    client, model = served
    kw = dict(model=model, prompt="pack my", max_tokens=8, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts
    assert len(set(texts)) > 1                            # each choice has its own seed
    single = client.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == texts[0]             # choice 0 samples with the seed itself
    assert first.usage.prompt_tokens == single.usage.prompt_tokens     # the prompt counts once
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 3 * 8
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts                              # interleaved chunks, by index
    with pytest.raises(openai.BadRequestError, match="16"):
        client.completions.create(**{**kw, "n": 17})


def test_invalid_chat_messages_are_bad_requests(served):
    client, model = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert "wizard" in e.value.message and "user" in e.value.message and e.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError, match="content"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": 5}], max_tokens=2)
    parts = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "the lazy"}, {"type": "text", "text": "dog"}]}]
    assert client.chat.completions.create(model=model, messages=parts, max_tokens=2).choices


def test_max_tokens_beyond_the_context_is_refused_up_front(served):
    client, model = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="the quick brown", max_tokens=CONTEXT)
    assert f"maximum context length is {CONTEXT} tokens" in e.value.message
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=f"{CONTEXT} tokens"):
        client.chat.completions.create(model=model, messages=_user("hi"), max_completion_tokens=CONTEXT)


def test_include_usage_sends_a_final_usage_chunk(served):
    client, model = served
    kw = dict(model=model, messages=_user("the lazy dog"), max_tokens=7, temperature=0)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(last.usage, k) for k in counts] == [getattr(plain.usage, k) for k in counts]
    # the same prompt again: what the first request left in the cache is reported as cached
    assert last.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_repeated_prompt_prefix_is_reported_as_cached_tokens(served):
    client, model = served
    system = {"role": "system", "content": "pack my box with five dozen liquor jugs. " * 4}
    first, second = (client.chat.completions.create(model=model, messages=[system] + _user(q), max_tokens=2,
                                                    temperature=0) for q in ("the quick", "the lazy"))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens      # the system prompt, once cached
    assert cached % 16 == 0 and cached < second.usage.prompt_tokens       # whole blocks, short of the question


def test_models_list_reports_the_context_length(served):
    client, model = served
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].max_model_len == CONTEXT
    assert client.models.retrieve(model).max_model_len == CONTEXT
