"""Next tokens from logits (worker/serving/sampling.py): greedy rows take the first maximum; sampled
rows, drawn together in batched tensor operations, draw from their own temperature-scaled, top-k
and top-p truncated distribution with one generator per request, seeded by its seed, so a seeded
request draws the same tokens alone or beside others; log-probabilities are those of the
distribution drawn from, before truncation."""
from __future__ import annotations

import torch

from shardwise.worker.serving.request import Request
from shardwise.worker.serving.sampling import Sampler, choose, draw, logprobs_of

VOCAB = 64


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_first_largest_logit():
    logits = torch.zeros(2, VOCAB)
    logits[0, 5] = logits[0, 9] = 1.0
    logits[1, 60] = 2.0
    assert choose(logits, [Request([1]), Request([1])], {}) == [5, 60]


def test_a_seeded_request_draws_the_same_tokens_whatever_runs_beside_it():
    steps = [_logits(1, seed) for seed in range(12)]
    others = [_logits(3, 100 + seed) for seed in range(12)]

    def tokens(neighbours, row):
        """The request's tokens over the steps, its logits at `row` among its neighbours'."""
        sampler, req = Sampler(), Request([1], temperature=0.9, top_p=0.95, seed=1234)
        out = []
        for x, y in zip(steps, others):
            logits = torch.cat([y[:row], x, y[row:len(neighbours)]])
            out.append(sampler(logits, neighbours[:row] + [req] + neighbours[row:])[row])
        return out, sampler, req

    alone, _, _ = tokens([], 0)
    mixed = [Request([1], temperature=1.5, seed=9), Request([1]), Request([1], temperature=0.3, top_k=5)]
    beside, sampler, req = tokens(mixed, 2)
    assert beside == alone and len(set(alone)) > 1
    assert tokens([Request([1], temperature=1.0, top_k=3)], 1)[0] == alone
    sampler.forget(req)
    assert req.id not in sampler.generators and mixed[0].id in sampler.generators


def test_top_k_and_top_p_never_draw_outside_each_rows_allowed_set():
    x = _logits(1, 7)[0]
    order = torch.argsort(x, descending=True).tolist()
    p = torch.softmax(x / 2.0, -1)                # the rows' temperature is 2
    # rows of one batch, each with its own truncation: top-3; top-p at half the top token's
    # mass (the top token alone); top-p reaching the first five tokens' mass; both
    mass5 = float(p[order[:5]].sum())
    kinds = [dict(top_k=3), dict(top_p=float(p[order[0]]) / 2), dict(top_p=mass5 - 1e-4), dict(top_k=2, top_p=0.999)]
    allowed = [set(order[:3]), {order[0]}, set(order[:5]), set(order[:2])]
    reqs = [Request([1], temperature=2.0, seed=s, **kinds[s % 4]) for s in range(400)]
    got = draw(x.expand(len(reqs), VOCAB), reqs, {})
    for s, token in enumerate(got.tolist()):
        assert token in allowed[s % 4], (kinds[s % 4], token)
    for k in (0, 2, 3):
        assert {t for s, t in enumerate(got.tolist()) if s % 4 == k} == allowed[k]   # all of it is reached


def test_temperature_shapes_the_drawn_frequencies_as_softmax_of_the_scaled_logits():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    n = 8000
    for temperature in (0.5, 1.0, 2.0):
        reqs = [Request([1], temperature=temperature, seed=s) for s in range(n)]
        counts = torch.bincount(draw(x.expand(n, 5), reqs, {}), minlength=5).double()
        want = torch.softmax(x.double() / temperature, -1)
        # within 4.5 standard deviations of each token's binomial count; the -30 logit never
        sd = (n * want * (1 - want)).sqrt()
        assert ((counts - n * want).abs() <= 4.5 * sd + 1).all(), (temperature, counts, n * want)
        assert counts[4] == 0


def test_a_batch_of_rows_mixing_greedy_and_sampled_requests_on_a_large_vocabulary():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g) * 4
    reqs = [Request([1]), Request([1], temperature=0.8, top_p=0.9, seed=1), Request([1]),
            Request([1], temperature=1.0, top_k=40, seed=2), Request([1], temperature=0.7, seed=3), Request([1])]
    tokens = choose(logits, reqs, {})
    for row in (0, 2, 5):
        assert tokens[row] == int(logits[row].argmax())
    assert int(logits[3].argsort(descending=True)[:40].eq(tokens[3]).sum()) == 1
    sorted_p, order = torch.sort(torch.softmax(logits[1] / 0.8, -1), descending=True)
    nucleus = order[:int((torch.cumsum(sorted_p, 0) - sorted_p < 0.9).sum())]
    assert tokens[1] in nucleus.tolist()


def test_logprobs_are_of_the_temperature_scaled_distribution_and_only_for_rows_that_ask():
    logits = _logits(3, 11)
    greedy, sampled, silent = Request([1], logprobs=2), Request([1], temperature=0.5, logprobs=0), Request([1])
    tokens = [3, 4, 5]
    logprobs_of(logits, [greedy, sampled, silent], tokens)
    raw, scaled = torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1] / 0.5, -1)
    (lp, alts), = greedy.token_logprobs
    assert abs(lp - float(raw[3])) < 1e-5
    assert [i for i, _ in alts] == torch.topk(raw, 2).indices.tolist()
    assert all(abs(v - float(raw[i])) < 1e-5 for i, v in alts)
    assert abs(sampled.token_logprobs[0][0] - float(scaled[4])) < 1e-5 and sampled.token_logprobs[0][1] == []
    assert silent.token_logprobs == []


def test_the_sampler_gives_each_drawn_token_its_logprob():
    logits = _logits(2, 5)
    reqs = [Request([1], temperature=0.7, top_k=10, seed=4, logprobs=3), Request([1], logprobs=1)]
    tokens = Sampler()(logits, reqs)
    for row, (req, token) in enumerate(zip(reqs, tokens)):
        ref = torch.log_softmax(logits[row] / (req.temperature or 1.0), -1)
        (lp, alts), = req.token_logprobs
        assert abs(lp - float(ref[token])) < 1e-5
        assert [i for i, _ in alts] == torch.topk(ref, req.logprobs).indices.tolist()


def test_a_nucleus_wider_than_the_first_candidates_is_drawn_from_whole():
    x = -torch.arange(5000, dtype=torch.float32) * 1e-4         # near-uniform, strictly ordered
    p = torch.softmax(x, -1)
    nucleus = int((torch.cumsum(p, 0) - p < 0.5).sum())          # ~2,400 tokens, past the first 1,024
    reqs = [Request([1], temperature=1.0, top_p=0.5, seed=s) for s in range(200)]
    got = draw(x.expand(len(reqs), 5000), reqs, {}).tolist()
    assert nucleus > 1024 and max(got) < nucleus and sum(t >= 1024 for t in got) > 50


def test_seeds_of_opposite_signs_draw_differently():
    x = torch.zeros(1, VOCAB)

    def tokens(seed: int) -> list[int]:
        sampler, req = Sampler(), Request([1], temperature=1.0, seed=seed)
        return [sampler(x, [req])[0] for _ in range(8)]
    assert tokens(5) != tokens(-5) and tokens(-5) == tokens(-5)
