"""Speculative decoding by prompt lookup (worker/serving/speculative.py): the proposer and the
acceptance rule alone, then real ranks: greedy text with speculation is the text without it, for
concurrent requests under a KV cache small enough to preempt, sampled and log-probability requests
beside them unchanged; and a real `shardwise serve --speculative ngram` reports its drafts and
their acceptance in /metrics."""
from __future__ import annotations

import argparse
import json
import random
import re
import urllib.request

import pytest
import torch

from shardwise.crds.models import Speculative
from shardwise.worker.cli.flags import speculative_setting
from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.engine import Engine
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.serving.request import Request
from shardwise.worker.serving.speculative import (Drafting, NgramIndex, SpeculativeConfig, accepted_drafts,
                                                  propose)

from .serve_process import serve_process

MAX_SEQ = 128


# ---- the proposer and the rule alone ---------------------------------------------------------------
def test_the_longest_ngram_matched_earlier_gives_the_drafts():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 9, 9, 7, 3, 5, 5, 1, 2, 3]
    # the 3-gram 1 2 3 occurred at 0..2, followed by 9 9 7; the 1-gram 3 occurred later (at 6,
    # followed by 5 5), but the longer match wins
    assert propose(seq, 3) == [9, 9, 7]
    assert propose(seq, 3, ngram_max=1) == [5, 5, 1]


def test_the_most_recent_earlier_occurrence_is_used_and_k_bounds_the_drafts():
    seq = [4, 5, 6, 10, 4, 5, 6, 20, 21, 4, 5, 6]
    assert propose(seq, 2) == [20, 21]
    assert propose(seq, 1) == [20]
    assert propose([4, 4, 4], 5) == [4]               # the match runs into the tail: what follows it
    assert propose([1, 2, 3, 4], 4) == []             # nothing repeats
    assert propose([7], 4) == []


def test_an_index_kept_as_the_sequence_grows_proposes_what_a_brute_force_search_does():
    def brute(seq, k, lo, hi):
        for n in range(hi, lo - 1, -1):
            for e in range(len(seq) - 1, n - 1, -1):     # most recent end before the tail's own
                if len(seq) > n and seq[e - n:e] == seq[len(seq) - n:]:
                    return seq[e:e + k]
        return []
    rng = random.Random(3)
    for lo, hi in ((1, 3), (2, 4), (1, 1)):
        seq = [rng.randrange(6) for _ in range(3)]
        index = NgramIndex(lo, hi)
        for _ in range(300):
            seq.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))   # 1 to 3 tokens a step
            assert index.propose(seq, 4) == brute(seq, 4, lo, hi)


def test_drafts_are_accepted_while_they_equal_the_greedy_token_at_their_position():
    assert accepted_drafts([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_drafts([5, 6, 7], [5, 6, 7, 9]) == 3
    assert accepted_drafts([5, 6, 7], [4, 6, 7, 9]) == 0
    assert accepted_drafts([], [4]) == 0


def test_a_request_whose_drafts_are_rejected_gets_fewer_and_grows_back_while_they_are_accepted():
    d = Drafting(NgramIndex(1, 3), limit=6)
    d.update(fed=6, accepted=1, k=6)
    assert d.limit == 2                       # one more than were accepted
    d.update(fed=2, accepted=0, k=6)
    assert d.limit == 1
    d.update(fed=0, accepted=0, k=6)          # nothing proposed: nothing learnt
    assert d.limit == 1
    for want in (3, 5, 6, 6):
        d.update(fed=d.limit, accepted=d.limit, k=6)
        assert d.limit == want


def test_bounds_and_flags_are_checked_and_a_pods_spec_is_the_default():
    with pytest.raises(WorkerError, match=r"^--draft-tokens must be 1 to 16, not 0$"):
        SpeculativeConfig(0, 1, 3)
    with pytest.raises(WorkerError, match=r"^--ngram must be MIN:MAX with 1 <= MIN <= MAX <= 8, not 4:2$"):
        SpeculativeConfig(4, 4, 2)
    flags = argparse.Namespace(speculative=None, draft_tokens=None, ngram=None)
    assert speculative_setting(flags) is None                                       # off by default
    pod = Speculative.model_validate({"method": "ngram", "draftTokens": 6, "ngramMax": 5})
    assert speculative_setting(flags, pod) == SpeculativeConfig(6, 2, 5)
    flags = argparse.Namespace(speculative=None, draft_tokens=2, ngram="2:2")
    assert speculative_setting(flags, pod) == SpeculativeConfig(2, 2, 2)            # a flag overrides it
    with pytest.raises(WorkerError, match=r"^--ngram must be MIN:MAX \(two integers\), not '3'$"):
        speculative_setting(argparse.Namespace(speculative="ngram", draft_tokens=None, ngram="3"))
    assert speculative_setting(argparse.Namespace(speculative="none", draft_tokens=None, ngram=None), pod) is None


# ---- real ranks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model):
    return str(tiny_model(tmp_path_factory.mktemp("tiny"), layers=3))


def _requests() -> list[Request]:
    """Random prompts (little repeats), repetitive ones (much does), one that runs into the context's
    end, and beside them a seeded sampled request and a greedy one asking for log-probabilities."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(2, 50, (5,), generator=g)]
    prompts += [[5, 6, 7, 8, 9] * 8, list(range(20, 45)) * 2, [3, 4] * 10]
    reqs = [Request(p, max_new_tokens=24 + i) for i, p in enumerate(prompts)]
    reqs.append(Request(list(range(30, 150)), max_new_tokens=24))       # 120 + 24 > MAX_SEQ: ends at 128
    reqs.append(Request([5, 6, 7, 8, 9] * 4, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=5))
    reqs.append(Request(list(range(60, 80)) * 2, max_new_tokens=20, logprobs=2))
    return reqs


def _answers(reqs: list[Request]):
    return [(r.token_ids, r.finish_reason, [[t for t, _ in alts] for _, alts in r.token_logprobs]) for r in reqs]


def _logprobs(reqs: list[Request]) -> list[float]:
    return [p for r in reqs for p, _ in r.token_logprobs]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_greedy_text_with_speculation_is_the_text_without_it_under_preemption(tiny, tp, pp):
    with LocalRuntime(RankSpec(tiny, tp, pp, max_batch=6, max_seq=MAX_SEQ)) as ctx:
        runs = {}
        for spec in (None, SpeculativeConfig(4, 1, 3)):
            # 240 tokens for 11 requests of up to 128 tokens, six at a time: decodes preempt
            engine = Engine(ctx.stage, 6, MAX_SEQ, [], kv_tokens=240, block_size=8, prefill_chunk=16,
                            speculative=spec)
            reqs = engine.generate(_requests())
            runs[spec] = engine, _answers(reqs), _logprobs(reqs)
            assert engine.stats.preempted > 0
            assert engine.pool.available == engine.pool.num_blocks       # every block given back
        (plain, want, want_logprobs), (fast, got, got_logprobs) = runs.values()
        assert got == want
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4) and len(want_logprobs) == 20
        assert len(want[8][0]) == MAX_SEQ - 120                          # the context's end, exactly
        stats = fast.speculator.stats
        assert 0 < stats.accepted <= stats.proposed
        # accepted drafts are tokens no row had to decode a step each for
        assert fast.stats.decode_tokens < plain.stats.decode_tokens
        assert fast.speculator.indexes == {}                              # forgotten as they ended


def test_a_served_model_reports_drafts_and_acceptance_in_metrics(tiny_serving_model):
    args = ["--model", str(tiny_serving_model), "--port", "0", "--max-seq-len", "256", "--max-batch", "2",
            "--threads", "1", "--speculative", "ngram", "--draft-tokens", "5"]
    prompt = "the quick brown fox jumps over the lazy dog. " * 4
    with serve_process(args) as (base, lines):
        def post(body):
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())
        greedy = post({"prompt": prompt, "max_tokens": 40, "temperature": 0})
        assert greedy["usage"]["completion_tokens"] == 40 or greedy["choices"][0]["finish_reason"] == "stop"
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = {k: float(v) for k, v in re.findall(r"^(shardwise_speculative_\w+) (\S+)$", text, re.M)}
        assert m["shardwise_speculative_draft_tokens_total"] > 0, text
        assert 0 < m["shardwise_speculative_accepted_tokens_total"] <= m["shardwise_speculative_draft_tokens_total"]
        assert m["shardwise_speculative_acceptance_rate"] == pytest.approx(
            m["shardwise_speculative_accepted_tokens_total"] / m["shardwise_speculative_draft_tokens_total"])
        assert m["shardwise_speculative_steps_total"] > 0
