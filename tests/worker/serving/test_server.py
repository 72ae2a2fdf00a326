"""The OpenAI-compatible server on a TP=2 x PP=2 launch of a tiny model: answers equal
transformers' greedy continuation, concurrent requests are batched without changing answers,
logprobs equal transformers' log_softmax at every step, SSE streams add up to the same text, bad
requests get 4xx JSON in OpenAI's one error shape and the server keeps serving. (The official
`openai` client against a `shardwise serve` process: test_openai_client.py.)"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.serving.http.server import App, Server, run_engine
from shardwise.worker.weights.tokenizer import load_tokenizer

PROMPTS = ["the quick brown", "pack my box with five", "the lazy dog", "five dozen liquor jugs over the"]


def _post(url: str, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model, pangrams):
    # 3 layers: TP 2 x PP 2 splits them unevenly
    path = tiny_model(tmp_path_factory.mktemp("tiny"), pangrams, layers=3, hidden=64, heads=4, kv_heads=2)
    spec = RankSpec(str(path), tensor=2, pipeline=2, max_batch=4, max_seq=128)
    runtime = LocalRuntime(spec)
    app = App("tiny", load_tokenizer(runtime.source))
    server = Server(app, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{server.port}"
    before = _get(base + "/healthz")
    ctx = runtime.start()
    stop = threading.Event()
    loop = threading.Thread(target=run_engine, args=(app, ctx, stop), daemon=True)
    loop.start()
    app.ready.wait(60)
    yield base, path, app, before
    stop.set()
    loop.join(30)
    runtime.stop()
    server.close()


def _reference(path, tokenizer, prompt: str, n: int) -> str:
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer.encode(prompt)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):].tolist())


def test_healthz_turns_ready_only_after_every_rank_loaded(served):
    base, _, _, before = served
    assert before[0] == 503 and json.loads(before[1])["status"] == "loading"
    status, body = _get(base + "/healthz")
    assert status == 200 and json.loads(body)["ranks"] == 4


def test_concurrent_completions_match_transformers_and_each_other(served):
    base, path, app, _ = served
    def one(prompt):
        status, body = _post(base + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        return json.loads(body)["choices"][0]["text"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(one, PROMPTS))
    alone = [one(p) for p in PROMPTS]
    assert together == alone
    assert alone[0] == _reference(path, app.tokenizer, PROMPTS[0], 8)


def test_stream_adds_up_to_the_same_text(served):
    base, _, _, _ = served
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0}
    _, plain = _post(base + "/v1/completions", body)
    status, raw = _post(base + "/v1/completions", {**body, "stream": True})
    events = [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == json.loads(plain)["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_streams_deltas(served):
    base, _, _, _ = served
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    status, body = _post(base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0})
    assert status == 200
    message = json.loads(body)["choices"][0]["message"]
    status, raw = _post(base + "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                        "stream": True})
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in raw.decode().split("\n\n")
              if e.startswith("data: {")]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


@pytest.mark.parametrize("path,raw,status,words", [
    ("/v1/completions", b'{"prompt": ', 400, "not valid JSON"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "'prompt'"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "token ids"),
    ("/v1/completions", b'[1, 2]', 400, "JSON object"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": "fox " * 400}).encode(), 400, "context"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 200}', 400, "maximum context length is 128 tokens"),
    ("/v1/completions", b'{"prompt": "x", "model": "llama"}', 404, "'llama' does not exist"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', 400, "from 1 to 16"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 21}', 400, "from 0 to 20"),
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', 400, "'seed'"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', 400, "'echo' is not supported"),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "'stream' is true"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400,
     "valid roles are: system, developer, user, assistant, tool"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "only text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400,
     "requires 'logprobs': true"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("/v1/nothing", b'{}', 404, "no route"),
])
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(served, path, raw, status, words):
    base, _, _, _ = served
    got, body = _post(base + path, None, raw=raw)
    assert got == status
    error = json.loads(body)["error"]
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    ok, _ = _post(base + "/v1/completions", {"prompt": "the", "max_tokens": 2})
    assert ok == 200


def test_logprobs_equal_transformers_at_every_step_while_batched(served):
    """Under TP and PP, batched with requests that ask for none: each token's logprob and its top
    alternatives are transformers' log_softmax of the same weights, step after step."""
    from transformers import LlamaForCausalLM
    base, path, app, _ = served
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0, "logprobs": 3}
    with ThreadPoolExecutor(3) as pool:
        plain = [pool.submit(_post, base + "/v1/completions", {**body, "prompt": p, "logprobs": None})
                 for p in PROMPTS[:2]]
        status, raw = _post(base + "/v1/completions", body)
        assert all(json.loads(f.result()[1])["choices"][0]["logprobs"] is None for f in plain)
    assert status == 200
    lp = json.loads(raw)["choices"][0]["logprobs"]
    ids = app.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    for step, logits in enumerate(out.logits):
        ref = torch.log_softmax(logits[0], -1)
        assert lp["token_logprobs"][step] == pytest.approx(ref.max().item(), abs=1e-4)
        assert list(lp["top_logprobs"][step].values()) == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)


def test_metrics_report_latency_ttft_tokens_weights_and_communication(served):
    base, _, _, _ = served
    _post(base + "/v1/completions", {"prompt": "the lazy", "max_tokens": 4, "temperature": 0})
    status, body = _get(base + "/metrics")
    text = body.decode()
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['shardwise_time_to_first_token_seconds_count{endpoint="/v1/completions"}'] >= 1
    assert values['shardwise_request_latency_seconds_count{endpoint="/v1/completions"}'] >= 1
    assert values["shardwise_generated_tokens_total"] >= 4
    weights = [v for k, v in values.items() if k.startswith("shardwise_weight_bytes{")]
    assert len(weights) == 4 and all(w > 0 for w in weights)
    assert values['shardwise_communication_seconds_total{rank="0"}'] > 0
    # the paged KV cache: every block in one state, the prompt's full blocks kept for reuse
    blocks = {state: values[f'shardwise_kv_cache_blocks{{state="{state}"}}'] for state in ("used", "cached", "free")}
    assert sum(blocks.values()) == 4 * 128 // values["shardwise_kv_cache_block_tokens"]
    assert values["shardwise_prefix_reused_tokens_total"] >= 0 and values["shardwise_preempted_requests_total"] == 0
