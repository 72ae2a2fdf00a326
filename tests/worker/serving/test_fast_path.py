"""The inference fast path (fused weights in huge pages, cached steps with index writes and
unmasked decode attention, optionally a compiled decode step) gives the logits of the plain
causal forward that training uses, for every kind of step the engine sends."""
from __future__ import annotations

import copy
import mmap

import pytest
import torch

from shardwise.worker.distributed.placement import place_in_huge_pages
from shardwise.worker.model.inference import install_fused_weights
from shardwise.worker.model.llama import ModelConfig, Transformer
from shardwise.worker.serving.cache_view import cache_view
from shardwise.worker.serving.cuda_graphs import buckets, padded_ints, unpack
from shardwise.worker.serving.fastpath import compile_decode

CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=8,
              num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=64)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def random_model(tied: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(tie_word_embeddings=tied, **CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def plain_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` from the uncached forward."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


class Driver:
    """Runs prompts through a fused, cached copy the way the engine does: each prompt prefilled
    into its own cache slot, then decode steps for several rows at once."""

    def __init__(self, model: Transformer, compiled: bool = False, padded: bool = False):
        self.model = copy.deepcopy(model)
        install_fused_weights(self.model)
        place_in_huge_pages(self.model)
        # padded: decode steps as a CUDA graph replays them (cuda_graphs.py), with static shapes
        # and the batch padded to a bucket whose extra rows write to scratch cache row 4.
        self.padded = padded
        self.model.setup_caches(4 + padded, 40)
        if compiled:
            compile_decode(self.model)

    def run(self, x, positions, blocks) -> torch.Tensor:
        with torch.no_grad():
            cache = cache_view(self.model, positions, blocks, static_shapes=self.padded)
            return self.model(x, positions=positions, cache=cache, last_only=True)

    def step(self, tokens, positions, slots) -> torch.Tensor:
        if self.padded and len(tokens[0]) == 1:
            b, n = len(tokens), bucket_of(len(tokens), 4)
            ints = padded_ints(torch.tensor(positions), torch.tensor(slots), n, scratch=4)
            # pad tokens are arbitrary: the scratch row holds nothing anyone reads
            x = torch.tensor([row[0] for row in tokens] + [7] * (n - b))[:, None]
            return self.run(x, *unpack(ints, n))[:b, -1]
        return self.run(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))[:, -1]


def bucket_of(b: int, max_batch: int) -> int:
    return next(n for n in buckets(max_batch) if n >= b)


def check_decode(model: Transformer, driver: Driver, slots: list[int]) -> None:
    seqs = [list(p) for p in PROMPTS]
    for seq, slot in zip(seqs, slots):
        got = driver.step([seq], [list(range(len(seq)))], [slot])
        torch.testing.assert_close(got[0], plain_logits(model, seq)[-1], atol=1e-4, rtol=1e-4)
        seq.append(int(got[0].argmax()))
    for _ in range(4):
        # All rows at once (different lengths: masked), then the first row alone (unmasked).
        got = driver.step([[s[-1]] for s in seqs], [[len(s) - 1] for s in seqs], slots)
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(got[row], plain_logits(model, seq)[-1], atol=1e-4, rtol=1e-4)
            seq.append(int(got[row].argmax()))
        got = driver.step([[seqs[0][-1]]], [[len(seqs[0]) - 1]], slots[:1])
        torch.testing.assert_close(got[0], plain_logits(model, seqs[0])[-1], atol=1e-4, rtol=1e-4)
        seqs[0].append(int(got[0].argmax()))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=["in-order", "shuffled"])
def test_fused_cached_steps_match_the_plain_forward(tied, slots):
    model = random_model(tied)
    check_decode(model, Driver(model), slots)


@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=["in-order", "shuffled"])
def test_padded_static_decode_matches_the_plain_forward(slots):
    """The step a CUDA graph replays: whole-cache masked attention, three rows padded to a
    bucket of four whose padding row writes to the scratch cache row, never to a request's."""
    assert buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6]
    model = random_model(True)
    check_decode(model, Driver(model, padded=True), slots)


def test_prefill_after_cached_tokens_matches():
    """A prompt continued in a second prefill step (positions not from 0: causal mask over the cache)."""
    model = random_model(True)
    driver = Driver(model)
    seq = PROMPTS[2]
    driver.step([seq[:5]], [list(range(5))], [1])
    got = driver.step([seq[5:]], [list(range(5, len(seq)))], [1])
    torch.testing.assert_close(got[0], plain_logits(model, seq)[-1], atol=1e-4, rtol=1e-4)


def test_weights_move_to_one_buffer_and_stay_tied():
    model = random_model(True)
    driver = Driver(model)
    fused = driver.model
    assert fused.tok_embeddings.weight_t is fused.output.weight_t
    matrices = [p for p in fused.parameters() if p.dim() == 2]
    storages = {p.untyped_storage().data_ptr() for p in matrices}
    assert len(storages) == (1 if hasattr(mmap, "MADV_HUGEPAGE") else len(matrices))


@pytest.mark.slow
def test_compiled_decode_matches_the_plain_forward():
    """`--decode compile`'s decode step on CPU (torch.compile, inductor); compiles a graph for
    each kind of step, so it takes a while. The row in cache row 0 alone is the kind whose
    guard checks are skipped after its first step; new caches of another length must bring
    them back, or the step would index the old cache's layout."""
    model = random_model(True)
    driver = Driver(model, compiled=True)
    check_decode(model, driver, [0, 3, 2])
    driver.model.setup_caches(4, 48)
    check_decode(model, driver, [0, 3, 2])
