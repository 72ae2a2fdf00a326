"""The token-budget scheduler's steps on the model: a ragged step (rows feeding different numbers
of tokens from their own positions through their own block tables, cache_view.ragged_view) gives
each row the logits of the plain causal forward, at every position a row asks for; and on real
ranks (TP and PP over gloo), requests whose prompts are fed together and beside running decodes
give the tokens each gives alone, and a decode row fed with a draft returns the logits of each of
its positions."""
from __future__ import annotations

import copy

import pytest
import torch

from shardwise.worker.model.inference import install_fused_weights
from shardwise.worker.serving.cache_view import ragged_view
from shardwise.worker.serving.engine import Engine
from shardwise.worker.serving.rank import LocalRuntime, RankSpec
from shardwise.worker.serving.request import Request
from tests.worker.serving.test_fast_path import plain_logits, random_model
from tests.worker.serving.test_paged_cache import alone
from tests.worker.texts import random_prompts

MAX_SEQ = 128


# ---- one ragged step on the model --------------------------------------------------------------
class Ragged:
    """A fused, cached copy of a model over a paged cache of 4-token blocks, fed ragged steps."""

    def __init__(self, model):
        self.model = copy.deepcopy(model)
        install_fused_weights(self.model)
        self.model.setup_caches(24, 64, 4)

    def step(self, rows: list[tuple[list[int], int, list[int], int]]) -> list[torch.Tensor]:
        """rows: (tokens, first position, block table, logits asked); each row's logits [k, V]."""
        counts = [len(t) for t, _, _, _ in rows]
        positions = torch.tensor([p for t, s, _, _ in rows for p in range(s, s + len(t))])
        nb = max(len(b) for _, _, b, _ in rows)
        blocks = torch.tensor([b + [0] * (nb - len(b)) for _, _, b, _ in rows])
        with torch.no_grad():
            cache = ragged_view(self.model, counts, positions, blocks)
            h = self.model(torch.tensor([[t for r in rows for t in r[0]]]), positions=positions[None],
                           cache=cache, return_hidden=True)[0]
            logits = self.model.output(h)
        out, at = [], 0
        for c, (_, _, _, k) in zip(counts, rows):
            out.append(logits[at + c - k:at + c])
            at += c
        return out


def test_a_ragged_step_gives_every_row_the_plain_forwards_logits_at_every_asked_position():
    model = random_model(True)
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    b = [100, 3, 77, 4, 9, 81, 7, 7, 22, 23, 24, 25, 26]
    c = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tables = {"a": [9, 2, 17], "b": [3, 4, 5, 20], "c": [11, 0, 6]}     # scattered blocks, one row in place
    r = Ragged(model)
    # a's whole prompt, b's first 5 tokens and c's first 2 in one step, a asking for every position
    got = r.step([(a[:7], 0, tables["a"], 7), (b[:5], 0, tables["b"], 1), (c[:2], 0, tables["c"], 0)])
    torch.testing.assert_close(got[0], plain_logits(model, a[:7]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][0], plain_logits(model, b[:5])[-1], atol=1e-4, rtol=1e-4)
    assert got[2].shape[0] == 0
    # a decodes one token, b feeds 6 more, c 1 more then 4 more asking for all: three kinds at once
    got = r.step([(a[7:8], 7, tables["a"], 1), (b[5:11], 5, tables["b"], 2), (c[2:3], 2, tables["c"], 1)])
    torch.testing.assert_close(got[0][0], plain_logits(model, a[:8])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], plain_logits(model, b[:11])[-2:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2][0], plain_logits(model, c[:3])[-1], atol=1e-4, rtol=1e-4)
    got = r.step([(a[8:10], 8, tables["a"], 2), (c[3:9], 3, tables["c"], 6), (b[11:12], 11, tables["b"], 1)])
    torch.testing.assert_close(got[0], plain_logits(model, a)[-2:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], plain_logits(model, c)[3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2][0], plain_logits(model, b[:12])[-1], atol=1e-4, rtol=1e-4)


def test_a_prompts_first_chunk_beside_decodes_attends_to_its_own_keys_alone_with_the_plain_logits():
    model = random_model(True)
    a, b, d = [5, 6, 7, 8, 9, 10, 11, 12], [100, 3, 77, 4, 9, 81, 7, 7, 22], [40, 41, 42, 43, 44, 45]
    tables = {"a": [9, 2], "b": [3, 4, 5], "d": [12, 13]}
    r = Ragged(model)
    r.step([(a[:7], 0, tables["a"], 1), (b[:4], 0, tables["b"], 0)])
    # a decodes, b feeds its next chunk, d's whole prompt arrives: d reads nothing of the cache
    rows = [(a[7:8], 7, tables["a"], 1), (b[4:9], 4, tables["b"], 1), (d, 0, tables["d"], 6)]
    view = ragged_view(r.model, [1, 5, 6], torch.tensor([7, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5]),
                       torch.tensor([[9, 2, 0], [3, 4, 5], [12, 13, 0]]))
    assert view.spans == [(6, 12)]                                      # d's tokens, causal over themselves
    assert sorted(i for g in view.groups for i in g.dest.tolist()) == list(range(6))   # a and b read the cache
    got = r.step(rows)
    torch.testing.assert_close(got[0][0], plain_logits(model, a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][0], plain_logits(model, b)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], plain_logits(model, d), atol=1e-4, rtol=1e-4)


# ---- real ranks --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_3_layers):
    return tiny_3_layers


def _recording(engine: Engine) -> list:
    """The steps the engine launches, recorded as it launches them."""
    steps, launch = [], engine.runner.launch

    def record(step):
        steps.append(step)
        launch(step)
    engine.runner.launch = record
    return steps


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_prompts_fed_together_and_beside_running_decodes_give_each_requests_tokens_alone(tiny, tp, pp):
    prompts = random_prompts(8, seed=20 + tp * 3 + pp)
    with LocalRuntime(RankSpec(tiny, tp, pp, max_batch=8, max_seq=MAX_SEQ)) as ctx:
        want = alone(ctx, prompts, 12)
        engine = Engine(ctx.stage, 8, MAX_SEQ, [], block_size=8, prefill_chunk=24, max_step_tokens=40)
        steps = _recording(engine)
        first = [engine.submit(Request(p, max_new_tokens=12)) for p in prompts[:3]]
        for _ in range(6):
            engine.step()                             # the first three decode
        later = [engine.submit(Request(p, max_new_tokens=12)) for p in prompts[3:]]
        while engine.step():
            pass
        assert [r.token_ids for r in first + later] == want
        assert any(s.decodes and len(s.seqs) - s.decodes >= 2 for s in steps)   # decodes and 2+ prompts at once
        assert all(sum(s.counts) <= 40 for s in steps)
        assert engine.pool.available == engine.pool.num_blocks


@pytest.mark.parametrize("pp", [1, 2])
def test_a_decode_row_fed_a_draft_returns_the_logits_of_each_position(tiny, pp):
    prompt = random_prompts(1, seed=9)[0]
    with LocalRuntime(RankSpec(tiny, 1, pp, max_batch=2, max_seq=MAX_SEQ)) as ctx:
        want = alone(ctx, [prompt], 10)[0]
        engine = Engine(ctx.stage, 2, MAX_SEQ, [], block_size=8)
        req = engine.submit(Request(prompt, max_new_tokens=10))
        engine.step()                                 # the prompt: want[0]
        seq = next(s for s in engine.scheduler.rows if s is not None)
        seq.draft = want[1:4] + [want[0]]             # three right, then a wrong one
        step = engine.scheduler.schedule(0)
        engine.runner.launch(step)
        step, logits = engine.runner.collect()
        assert step.logits == [5] and logits.shape[0] == 5
        assert logits.argmax(-1).tolist()[:4] == want[1:5]       # each position's next token
        engine.scheduler.complete(step)
        engine.scheduler.append_tokens(step, [want[1:5]])        # three kept, and the fourth position's
        while engine.step():
            pass
        assert req.token_ids == want
