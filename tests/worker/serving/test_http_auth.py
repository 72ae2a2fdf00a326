"""API keys (worker/serving/http/auth.py, `shardwise serve --api-key-file`): a real `shardwise
serve` process as the official `openai` client sees it answers the right key and refuses a wrong
or missing one with AuthenticationError (OpenAI's 401, invalid_api_key); /healthz and /metrics
stay open; the keys never reach the server's log. No ranks for the unit checks."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.http.auth import INCORRECT, MISSING, ApiKeys

from .serve_process import serve_process
from .test_http_framing import exchange, serve, status_and_error

openai = pytest.importorskip("openai")

KEYS = ["sk-first-key-0123456789", "sk-second-key-abcdef"]


def test_keys_from_a_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("\n  sk-a  \n\nsk-b\n")
    keys = ApiKeys.from_file(str(f))
    assert keys.refusal("Bearer sk-a") is None and keys.refusal("bearer sk-b") is None
    assert keys.refusal("Bearer sk-c") == INCORRECT and keys.refusal("Bearer sk-") == INCORRECT
    assert keys.refusal(None) == MISSING and keys.refusal("Basic sk-a") == MISSING
    assert keys.refusal("Bearer ") == MISSING
    (tmp_path / "empty").write_text("\n\n")
    with pytest.raises(WorkerError, match="holds no key"):
        ApiKeys.from_file(str(tmp_path / "empty"))
    with pytest.raises(WorkerError, match="cannot read"):
        ApiKeys.from_file(str(tmp_path / "missing"))


def test_v1_needs_a_key_and_probes_do_not():
    srv, _ = serve(api_keys=ApiKeys(KEYS))
    try:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 33\r\n"
        code, error = status_and_error(exchange(srv.port, head + b"\r\n" + body))
        assert code == 401 and error["code"] == "invalid_api_key" and error["message"] == MISSING
        got = exchange(srv.port, head + b"Authorization: Bearer sk-wrong\r\n\r\n" + body)
        assert status_and_error(got) == (401, {"message": INCORRECT, "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"})
        assert b"WWW-Authenticate: Bearer" in got
        got = exchange(srv.port, head + f"Authorization: Bearer {KEYS[1]}\r\n\r\n".encode() + body)
        assert got.startswith(b"HTTP/1.1 200")
        assert status_and_error(exchange(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 401
        assert exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                        ).startswith(b"HTTP/1.1 200")       # /metrics: with a real engine, below
    finally:
        srv.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_serving_model):
    path = tiny_serving_model
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    args = ["--model", str(path), "--port", "0", "--max-seq-len", "128", "--max-batch", "2", "--threads", "1",
            "--api-key-file", str(keys)]
    with serve_process(args) as (base, lines):
        yield base, lines, str(path)


def _client(base: str, key: str):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_openai_client_with_the_right_key_is_served(served):
    base, _, model = served
    for key in KEYS:
        # greedy, so that the answer's length does not hang on whether an end token is sampled
        out = _client(base, key).completions.create(model=model, prompt="the quick", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
    chat = _client(base, KEYS[0]).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the quick"}], max_tokens=2, temperature=0)
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("key", ["sk-wrong", KEYS[0] + "x", KEYS[0][:-1]])   # no key: the raw test above
def test_the_openai_client_with_a_wrong_or_missing_key_is_refused(served, key):
    base, _, model = served
    with pytest.raises(openai.AuthenticationError) as e:
        _client(base, key).completions.create(model=model, prompt="the quick", max_tokens=3)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(base, key).models.list()


def test_probes_stay_open_and_keys_never_reach_the_log(served):
    base, lines, _ = served
    for probe in ("/healthz", "/metrics"):
        with urllib.request.urlopen(base + probe, timeout=10) as r:
            assert r.status == 200
    log = "".join(lines)
    assert not any(k in log for k in KEYS)


def test_the_pod_command_takes_the_same_key_file(tmp_path, tiny_serving_model):
    """`shardwise worker --api-key-file` (one pod, one rank): /v1/* needs a key, /healthz does not."""
    import os
    import signal

    from shardwise.crds.contract import ModelContract, PodContract, ServingContract
    from shardwise.crds.plan import ShardPlan, StagePlacement
    from shardwise.worker.serving.rank import free_port

    model = tiny_serving_model
    plan = ShardPlan(tensor=1, pipeline=1, replicas=1, num_layers=2, placements=[
        StagePlacement(replica=0, stage=0, node="n0", gpus=1, layer_start=0, layer_end=2, embedding=True, head=True)])
    port, contract, keys = free_port(), tmp_path / "contract.json", tmp_path / "keys"
    contract.write_text(PodContract(
        plan=plan, model=ModelContract(path=str(model), format="auto", dtype="auto"), workload="inference",
        serving=ServingContract(port=port, model_name="tiny"), termination_log=str(tmp_path / "log")).to_json())
    keys.write_text(KEYS[0] + "\n")
    env = {**os.environ, "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "POD_IP": "127.0.0.1"}
    pod = subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", str(contract), "--device",
                            "cpu", "--api-key-file", str(keys)], env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert pod.poll() is None and time.monotonic() < deadline, pod.stderr.read() if pod.poll() else "timeout"
            time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/v1/models", timeout=10)
        assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
        assert [m.id for m in _client(base, KEYS[0]).models.list()] == ["tiny"]
    finally:
        pod.send_signal(signal.SIGTERM)
        try:
            pod.wait(30)
        except subprocess.TimeoutExpired:
            pod.kill()
            pod.wait()
