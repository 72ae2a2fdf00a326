"""The load benchmark (benchmarks/serving_load.py, benchmarks/load_gen.py): its seeded workload, its
percentiles and report, and one short closed-loop run against a real `shardwise serve` whose four
requests it counts, with no failure. llama.cpp's server is not needed."""
from __future__ import annotations

import asyncio
import importlib
import math
import random
import sys
from pathlib import Path

import pytest

from .serve_process import serve_process

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def load_gen():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("load_gen")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_lengths_are_seeded_log_normal_with_the_asked_mean_and_bounds(load_gen):
    dist = load_gen.LogNormal(161, 1.0, 8, 100_000)
    assert [dist.sample(random.Random(7)) for _ in range(3)] == [dist.sample(random.Random(7)) for _ in range(3)]
    rnd = random.Random(0)
    draws = [dist.sample(rnd) for _ in range(20_000)]
    assert 150 < sum(draws) / len(draws) < 172                    # the published mean
    assert sorted(draws)[len(draws) // 2] < 120                   # a long right tail: median < mean
    clipped = load_gen.LogNormal(64, 0.6, 8, 100)
    assert all(8 <= clipped.sample(rnd) <= 100 for _ in range(2000))


def test_same_seed_same_requests_and_prefix_sharing_as_asked(load_gen):
    w = load_gen.Workload(shared_prefix=0.5, prefixes=2, prefix_tokens=50, seed=3)
    first, again = load_gen.make_requests(w, 200), load_gen.make_requests(w, 200)
    assert first == again
    assert first != load_gen.make_requests(load_gen.Workload(shared_prefix=0.5, prefixes=2, seed=4), 200)
    shared = [r for r in first if r.system]
    assert 70 < len(shared) < 130 and len({r.system for r in shared}) == 2
    assert len({r.prompt[:40] for r in first}) == 200                  # no accidental common prefix
    assert not any(r.system for r in load_gen.make_requests(load_gen.Workload(), 50))
    body = load_gen.body(shared[0], chat=False, temperature=0, model=None)
    assert body["prompt"].startswith(shared[0].system) and body["max_tokens"] == shared[0].max_tokens
    assert body["ignore_eos"] is True and "model" not in body
    chat = load_gen.body(shared[0], chat=True, temperature=0, model="m")
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] and chat["model"] == "m"


def test_percentiles_interpolate_between_ranks(load_gen):
    values = [float(v) for v in range(1, 101)]
    random.Random(1).shuffle(values)
    assert load_gen.percentile(values, 50) == pytest.approx(50.5)
    assert load_gen.percentile(values, 90) == pytest.approx(90.1)
    assert load_gen.percentile(values, 99) == pytest.approx(99.01)
    assert load_gen.percentile([3.0], 99) == 3.0
    assert math.isnan(load_gen.percentile([], 50))


def test_report_counts_failures_with_the_first_error_of_each_kind(load_gen):
    O = load_gen.Outcome
    outcomes = [O(ok=True, asked=4, tokens=4, prompt_tokens=10, ttft=0.1, gaps=[0.01, 0.03, 0.02]),
                O(ok=True, asked=4, tokens=2, prompt_tokens=20, ttft=0.3, gaps=[0.04]),
                O(error_kind="HTTP 429", error="queue full"), O(error_kind="HTTP 429", error="later"),
                O(error_kind="ServerDisconnectedError", error="closed")]
    r = load_gen.summarize(outcomes, 2.0)
    assert (r["requests"], r["ok"], r["failed"], r["short"]) == (5, 2, 3, 1)
    assert r["errors"] == {"HTTP 429": {"count": 2, "first": "queue full"},
                           "ServerDisconnectedError": {"count": 1, "first": "closed"}}
    assert (r["requests_per_s"], r["output_tokens_per_s"], r["mean_prompt_tokens"]) == (1.0, 3.0, 15.0)
    assert r["ttft_p50"] == pytest.approx(0.2) and r["itl_p50"] == pytest.approx(0.025)
    text = load_gen.render_table([{"server": "s", "scenario": "closed c=2", **r}])
    assert "closed c=2" in text and "3.0" in text and "200/" in text
    assert "s closed c=2: 2 x HTTP 429: queue full" in text


def test_a_short_run_against_a_real_server_counts_every_request(load_gen, tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--max-seq-len", "128", "--max-batch", "4",
            "--threads", "1"]
    w = load_gen.Workload(inputs=load_gen.LogNormal(12, 0.5, 4, 24), outputs=load_gen.LogNormal(6, 0.3, 3, 8))
    specs = load_gen.make_requests(w, 4)
    with serve_process(args) as (base, _):
        outcomes, seconds = asyncio.run(load_gen.drive(base, load_gen.Scenario("closed", 4, concurrency=2),
                                                       specs, timeout=60))
    r = load_gen.summarize(outcomes, seconds)
    assert (r["requests"], r["ok"], r["failed"]) == (4, 4, 0), r["errors"]
    assert r["output_tokens"] == sum(o.tokens for o in outcomes) > 0
    assert all(o.prompt_tokens and o.ttft is not None for o in outcomes)
    assert r["ttft_p99"] >= r["ttft_p50"] > 0 and r["output_tokens_per_s"] > 0


def test_ratios_compare_only_when_both_servers_generated_the_same_tokens(load_gen):
    serving_load = importlib.import_module("serving_load")
    base = {"requests_per_s": 1.0, "ttft_p50": 0.5, "ttft_p99": 1.0, "itl_p50": 0.01, "itl_p99": 0.02}
    rows = [{"server": "shardwise", "scenario": "closed c=8", "output_tokens": 100, "short": 0,
             "output_tokens_per_s": 30.0, **base},
            {"server": "llama.cpp", "scenario": "closed c=8", "output_tokens": 100, "short": 0,
             "output_tokens_per_s": 20.0, **base, "ttft_p99": 4.0},
            {"server": "shardwise", "scenario": "burst 64", "output_tokens": 90, "short": 2,
             "output_tokens_per_s": 10.0, **base},
            {"server": "llama.cpp", "scenario": "burst 64", "output_tokens": 100, "short": 0,
             "output_tokens_per_s": 10.0, **base}]
    (c8, burst) = serving_load.ratios(rows)
    assert c8["scenario"] == "closed c=8" and c8["same_tokens"] is True
    assert c8["output_tokens_per_s"] == pytest.approx(1.5) and c8["ttft_p99"] == pytest.approx(0.25)
    assert burst["same_tokens"] is False
    text = serving_load.render_ratios([c8, burst])
    assert "1.50" in text and "NO" in text.splitlines()[-1]
    args = serving_load.parse_args(["--concurrency", "1,8", "--burst", "64", "--rate", "0.5"])
    assert [s.name for s in serving_load.scenarios(args)] == ["closed c=1", "closed c=8", "burst 64",
                                                               "poisson 0.5/s"]
    assert [s.requests for s in serving_load.scenarios(args)] == [16, 32, 64, 64]
