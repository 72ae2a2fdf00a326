"""Next tokens from logits (worker/serving/sampling.py): greedy rows take the first maximum; sampled
rows draw from the temperature-scaled, top-k and top-p truncated distribution with one generator
per request, seeded by its seed, so a seeded request draws the same tokens alone or beside others;
log-probabilities are those of the distribution drawn from, before truncation."""
from __future__ import annotations

import torch

from shardwise.worker.serving.request import Request
from shardwise.worker.serving.sampling import Sampler, choose, logprobs_of

VOCAB = 64


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_first_largest_logit():
    logits = torch.zeros(2, VOCAB)
    logits[0, 5] = logits[0, 9] = 1.0
    logits[1, 60] = 2.0
    assert choose(logits, [Request([1]), Request([1])], {}) == [5, 60]


def test_a_seeded_request_draws_from_its_own_generator_what_a_reference_draw_gives():
    steps = [_logits(3, seed) for seed in range(6)]
    req = Request([1], temperature=0.7, seed=1234)
    want, g = [], torch.Generator().manual_seed(1234)
    for x in steps:
        want.append(int(torch.multinomial(torch.softmax(x[1] / 0.7, dim=-1), 1, generator=g)))
    sampler = Sampler()
    beside = [Request([1], temperature=1.0, seed=9), req, Request([1])]
    assert [sampler(x, beside)[1] for x in steps] == want
    alone = Sampler()
    again = Request([1], temperature=0.7, seed=1234)
    assert [alone(x[1:2], [again])[0] for x in steps] == want
    sampler.forget(req)
    assert req.id not in sampler.generators and beside[0].id in sampler.generators


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    x = _logits(1, 7)[0]
    top3 = set(torch.topk(x, 3).indices.tolist())
    sampler = Sampler()
    drawn = {sampler(x[None], [Request([1], temperature=2.0, top_k=3, seed=s)])[0] for s in range(40)}
    assert drawn <= top3 and len(drawn) > 1
    p = torch.softmax(x, -1)
    best = int(p.argmax())
    nucleus = {sampler(x[None], [Request([1], temperature=1.0, top_p=float(p[best]) / 2, seed=s)])[0] for s in range(20)}
    assert nucleus == {best}                      # the top token alone reaches top_p


def test_logprobs_are_of_the_temperature_scaled_distribution_and_only_for_rows_that_ask():
    logits = _logits(3, 11)
    greedy, sampled, silent = Request([1], logprobs=2), Request([1], temperature=0.5, logprobs=0), Request([1])
    tokens = [3, 4, 5]
    logprobs_of(logits, [greedy, sampled, silent], tokens)
    raw, scaled = torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1] / 0.5, -1)
    (lp, alts), = greedy.token_logprobs
    assert abs(lp - float(raw[3])) < 1e-5
    assert [i for i, _ in alts] == torch.topk(raw, 2).indices.tolist()
    assert abs(sampled.token_logprobs[0][0] - float(scaled[4])) < 1e-5 and sampled.token_logprobs[0][1] == []
    assert silent.token_logprobs == []
