"""A real `shardwise serve` under load exports the Gateway API Inference Extension's model-server
protocol metrics (queued and running requests, KV-cache use 0-1, LoRA info) under the names an
endpoint picker scrapes, with the same values as shardwise's own series of the same scrape, and
reads idle once the load is gone. Parsed with prometheus_client's text parser, as a scraper would."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardwise.crds import names

from .serve_process import serve_process
from .test_http_admission import LONG, _post

LOAD = 4


def _scrape(base: str) -> dict[str, list]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:      # by sample name: counters' samples end in _total
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(m: dict, name: str, **labels) -> float:
    return next(s.value for s in m[name] if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.timeout(300)
def test_a_loaded_server_reports_queue_running_and_kv_use_under_the_protocol_names(tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--max-seq-len", "1024", "--max-batch", "1",
            "--threads", "1"]
    with serve_process(args) as (base, _):
        idle = _scrape(base)
        assert _value(idle, "vllm:num_requests_waiting") == 0 and _value(idle, "vllm:num_requests_running") == 0
        threads = [threading.Thread(target=_post, args=(base, LONG), daemon=True) for _ in range(LOAD)]
        for t in threads:
            t.start()
        deadline, loaded = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            m = _scrape(base)
            if _value(m, "vllm:num_requests_waiting") >= LOAD - 1:
                loaded = m
                break
            time.sleep(0.02)
        assert loaded is not None, "the queue never held the requests one row could not take"
        # one row: one running, the rest queued; the same numbers as shardwise's own series
        assert _value(loaded, "vllm:num_requests_running") == 1
        assert _value(loaded, "vllm:num_requests_waiting") == _value(loaded, "shardwise_waiting_requests")
        assert _value(loaded, "vllm:num_requests_running") == _value(loaded, "shardwise_running_requests")
        blocks = {s: _value(loaded, "shardwise_kv_cache_blocks", state=s) for s in ("used", "cached", "free")}
        use = blocks["used"] / sum(blocks.values())
        for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):
            assert 0 < _value(loaded, name) <= 1 and _value(loaded, name) == pytest.approx(use)
        lora = loaded["vllm:lora_requests_info"][0]
        assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert lora.value > 1.7e9     # a Unix time: when the adapters were last updated
        for t in threads:
            t.join(120)
        after = _scrape(base)
        assert _value(after, "vllm:num_requests_waiting") == 0 and _value(after, "vllm:num_requests_running") == 0
        assert _value(after, "vllm:gpu_cache_usage_perc") == 0
        # the histogram the operator's autoscaler reads for ttftP90Seconds, every request counted
        ttft = after[names.METRIC_TTFT + "_bucket"]
        assert sum(s.value for s in ttft if s.labels["le"] == "+Inf") >= LOAD
