"""Compressed gradient averaging (worker/training/compression.py) between real gloo ranks on 127.0.0.1:
int8 within its quantization bound at a quarter of the bytes, int4 within its bound at an eighth,
top-k sending 1% of the elements and their exact mean, top-k + int4 the same elements in 4 bits,
PowerSGD recovering a low-rank mean and carrying the rest to the next step, error feedback as the difference between top-k SGD that converges and one
that stalls, residuals that survive a checkpoint and an overflowed step, one-line errors for bad
options.

Each rank is a fresh interpreter (multiprocessing "spawn"), started once for the module. pytest
imports this file with --import-mode=importlib, so a child could not import it by name: the child
runs it with runpy.run_path instead, under the name "__compression_rank__" (bottom of the file)."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import runpy
import socket
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardwise.worker.training.compression import METHODS, GradientCompressor, plain_all_reduce_mean_

WORLD = 2
# shape, dtype, magnitude: chunks and tensors do not line up (19047 elements); top-k picks from the
# fp32 tensors (the bf16 one, with ties among its rounded values, is the smallest)
SHAPES = [((300, 50), torch.float32, 10.0), ((7,), torch.float32, 100.0), ((40, 101), torch.bfloat16, 1.0)]
N = sum(math.prod(shape) for shape, _, _ in SHAPES)


# -- running ranks ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(scenarios: dict) -> dict:
    """Run scenarios {name: (function name, kwargs)} one after the other in WORLD fresh processes
    joined by gloo (one start-up for all: starting two interpreters with torch is most of the
    time); {name: {rank: what the function returned}}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=runpy.run_path, args=(__file__,), kwargs={
        "run_name": "__compression_rank__",
        "init_globals": {"RANK_JOB": (scenarios, rank, port, results)}}) for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        answers = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    failed = {rank: a for rank, a in answers.items() if isinstance(a, str)}
    assert not failed, "\n".join(f"rank {rank}: {a}" for rank, a in failed.items())
    return {name: {rank: answers[rank][name] for rank in answers} for name in scenarios}


def _rank_main(scenarios: dict, rank: int, port: int, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        try:
            out = {name: globals()[fn](rank, **kwargs) for name, (fn, kwargs) in scenarios.items()}
            results.put((rank, out))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def ranks() -> dict:
    return _spawn({
        "int8": ("_one_step", {"method": "int8", "chunk": 1024}),
        "topk": ("_one_step", {"method": "topk", "density": 0.01}),
        "int4": ("_one_step", {"method": "int4", "chunk": 1024}),
        "topk-int4": ("_one_step", {"method": "topk-int4", "density": 0.01, "chunk": 64}),
        "regression": ("_regression", {"steps": 300, "lr": 3.0}),
        "overflow": ("_overflow_and_checkpoint", {}),
        "powersgd": ("_low_rank", {}),
        "powersgd_overflow": ("_powersgd_overflow", {}),
    })


def _grads(rank: int) -> list[torch.Tensor]:
    """This rank's gradients: another seed per rank, tensors of different magnitudes."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(shape, generator=g) * scale).to(dtype) for shape, dtype, scale in SHAPES]


def _flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).numpy()


# -- scenarios (run in the ranks) ----------------------------------------------------------------

def _one_step(rank: int, method: str, **options) -> dict:
    grads = _grads(rank)
    before = _flat(grads)
    comp = GradientCompressor(method, dist.group.WORLD, **options)
    comp.all_reduce_mean_(grads)
    return {"before": before, "after": _flat(grads), "dtypes": [g.dtype for g in grads],
            "bytes_sent": comp.bytes_sent, "bytes_uncompressed": comp.bytes_uncompressed,
            "plain_bytes": plain_all_reduce_mean_(_grads(rank), None)}


def _regression(rank: int, steps: int, lr: float) -> dict:
    """Linear regression on sparse features (2000 weights, 5 active features per sample, noise 0.1);
    each rank holds its own 5000 samples. Full-batch SGD on the rank's shard, gradients averaged
    plainly, by top-k 1% with error feedback, and by top-k 1% without. Loss over all the data."""
    d, per_rank, active = 2000, 5000, 5
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(d, generator=g)
    idx = torch.randint(0, d, (WORLD * per_rank, active), generator=g)
    val = torch.randn(WORLD * per_rank, active, generator=g)
    y = (w_true[idx] * val).sum(1) + 0.1 * torch.randn(WORLD * per_rank, generator=g)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    def loss_and_grad(w, idx, val, y):
        r = (w[idx] * val).sum(1) - y
        grad = torch.zeros_like(w).index_add_(0, idx.reshape(-1), (r[:, None] * val).reshape(-1))
        return (r * r).mean().item(), grad * (2 / len(y))

    out = {"initial": loss_and_grad(torch.zeros(d), idx, val, y)[0]}
    for name, comp in [("plain", None),
                       ("ef", GradientCompressor("topk", None, density=0.01)),
                       ("no_ef", GradientCompressor("topk", None, density=0.01, error_feedback=False))]:
        w = torch.zeros(d)
        for _ in range(steps):
            _, grad = loss_and_grad(w, idx[mine], val[mine], y[mine])
            if comp is None:
                plain_all_reduce_mean_([grad], None)
            else:
                comp.all_reduce_mean_([grad])
            w -= lr * grad
        out[name] = loss_and_grad(w, idx, val, y)[0]
        out[name + "_w"] = w.numpy()
    return out


def _overflow_and_checkpoint(rank: int) -> dict:
    """Three top-k steps: finite, one with a NaN and an inf on rank 0 (an overflowed step, which the
    trainer would skip), finite again; then the residuals through state_dict into a new compressor."""
    comp = GradientCompressor("topk", None, density=0.05)
    means = []
    for step in range(3):
        grads = _grads(rank + 10 * step)
        if step == 1 and rank == 0:
            grads[0][0, 0], grads[0][5, 5] = float("nan"), float("inf")
        comp.all_reduce_mean_(grads)
        means.append(_flat(grads))
    state = comp.state_dict()
    restored = GradientCompressor("topk", None, density=0.05)
    restored.load_state_dict(state)
    a, b = _grads(rank + 30), _grads(rank + 30)
    comp.all_reduce_mean_(a)
    restored.all_reduce_mean_(b)
    residuals = state["residuals"]
    return {"means": means, "residual_finite": all(bool(torch.isfinite(r).all()) for r in residuals.values()),
            "positions": sorted(residuals), "continued": _flat(a), "restored": _flat(b)}


# gradients of the PowerSGD scenario: a 60 x 40 matrix that is rank 1 on each rank (another on
# each, so their mean is rank 2), a 1-D tensor and a 5 x 3 matrix (both sent uncompressed)
LOW_RANK_SHAPES = [(60, 40), (7,), (5, 3)]


def _low_rank_grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    u, v = torch.randn(60, 1, generator=g), torch.randn(1, 40, generator=g)
    return [u @ v, torch.randn(7, generator=g), torch.randn(5, 3, generator=g)]


def _low_rank(rank: int) -> dict:
    """Rank 2 on a rank-2 mean: one step. Rank 1: a step of the gradients, then a step of zeros
    (what arrives then is what error feedback carried), then the state into a new compressor."""
    out = {"before": _flat(_low_rank_grads(rank))}
    two = GradientCompressor("powersgd", None, rank=2)
    grads = _low_rank_grads(rank)
    two.all_reduce_mean_(grads)
    out["rank2"], out["rank2_bytes"] = _flat(grads), two.bytes_sent
    one = GradientCompressor("powersgd", None, rank=1)
    first = _low_rank_grads(rank)
    one.all_reduce_mean_(first)
    out["rank1_first"], out["rank1_bytes"] = _flat(first), one.bytes_sent
    out["rank1_residual"] = one.state_dict()["residuals"][0].numpy()
    restored = GradientCompressor("powersgd", None, rank=1)
    restored.load_state_dict(one.state_dict())
    second = [torch.zeros(s) for s in LOW_RANK_SHAPES]
    again = [torch.zeros(s) for s in LOW_RANK_SHAPES]
    one.all_reduce_mean_(second)
    restored.all_reduce_mean_(again)
    out["rank1_second"], out["restored_second"] = _flat(second), _flat(again)
    return out


def _powersgd_overflow(rank: int) -> dict:
    """Three PowerSGD steps, the second with a NaN on rank 0: it poisons that step's P and Q."""
    comp = GradientCompressor("powersgd", None, rank=2)
    means = []
    for step in range(3):
        grads = _grads(rank + 10 * step)
        if step == 1 and rank == 0:
            grads[0][3, 4] = float("nan")
        comp.all_reduce_mean_(grads)
        means.append(_flat(grads))
    return {"means": means}


# -- tests ----------------------------------------------------------------------------------------

def test_int8_mean_within_quantization_bound_at_a_quarter_of_the_bytes(ranks):
    chunk = 1024
    ranks = ranks["int8"]
    assert np.array_equal(ranks[0]["after"], ranks[1]["after"]), "replicas got different means"
    assert ranks[0]["dtypes"] == [dtype for _, dtype, _ in SHAPES]
    exact = (ranks[0]["before"] + ranks[1]["before"]) / WORLD
    # Round to nearest: each rank's error is at most half a step, absmax/127 of its chunk.
    chunks = math.ceil(N / chunk)
    bound = np.zeros(N)
    for r in range(WORLD):
        padded = np.zeros(chunks * chunk)
        padded[:N] = np.abs(ranks[r]["before"])
        bound += np.repeat(padded.reshape(chunks, chunk).max(1) / 127 / 2, chunk)[:N] / WORLD
    bf16 = np.zeros(N, dtype=bool)
    bf16[-40 * 101:] = True
    bound = bound * 1.0001 + np.where(bf16, np.abs(exact) * 2.0 ** -8, 0)  # the bf16 gradient's rounding
    err = np.abs(ranks[0]["after"] - exact)
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements outside the bound, worst {err.max()}"
    assert err.max() > 0  # it did quantize

    for r in range(WORLD):
        assert ranks[r]["bytes_sent"] == N + 4 * chunks  # int8 payload + one fp32 scale per chunk
        assert ranks[r]["bytes_uncompressed"] == ranks[r]["plain_bytes"] == 4 * N
        assert 0.25 < ranks[r]["bytes_sent"] / ranks[r]["bytes_uncompressed"] < 0.252


def _quantization_bound(ranks, chunk: int, qmax: int) -> np.ndarray:
    """Round to nearest: each rank's error is at most half a step, absmax/qmax of its chunk; plus the
    bf16 gradient's own rounding when the mean is written back."""
    chunks = math.ceil(N / chunk)
    bound = np.zeros(N)
    for r in range(WORLD):
        padded = np.zeros(chunks * chunk)
        padded[:N] = np.abs(ranks[r]["before"])
        bound += np.repeat(padded.reshape(chunks, chunk).max(1) / qmax / 2, chunk)[:N] / WORLD
    exact = (ranks[0]["before"] + ranks[1]["before"]) / WORLD
    bf16 = np.zeros(N, dtype=bool)
    bf16[-40 * 101:] = True
    return bound * 1.0001 + np.where(bf16, np.abs(exact) * 2.0 ** -8, 0)


def test_int4_mean_within_its_quantization_bound_at_an_eighth_of_the_bytes(ranks):
    chunk = 1024
    ranks = ranks["int4"]
    assert np.array_equal(ranks[0]["after"], ranks[1]["after"]), "replicas got different means"
    exact = (ranks[0]["before"] + ranks[1]["before"]) / WORLD
    err = np.abs(ranks[0]["after"] - exact)
    bound = _quantization_bound(ranks, chunk, 7)
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements outside the bound, worst {err.max()}"
    # coarser than int8: some elements are off by more than int8's bound allows
    assert (err > _quantization_bound(ranks, chunk, 127)).any()
    for r in range(WORLD):
        assert ranks[r]["bytes_sent"] == math.ceil(N / 2) + 4 * math.ceil(N / chunk)  # two per byte + scales
        assert 0.125 < ranks[r]["bytes_sent"] / ranks[r]["bytes_uncompressed"] < 0.127


def test_topk_int4_sends_the_topk_indices_with_values_in_four_bits(ranks):
    chunk, ranks = 64, ranks["topk-int4"]
    k = math.ceil(0.01 * N)  # 191
    assert np.array_equal(ranks[0]["after"], ranks[1]["after"])
    sent = np.zeros(N, dtype=bool)
    for r in range(WORLD):
        sent[np.argsort(-np.abs(ranks[r]["before"]))[:k]] = True
    after = ranks[0]["after"]
    assert not after[~sent].any()  # only the top-k positions of some rank are non-zero
    exact = np.zeros(N)
    for r in range(WORLD):
        top = np.argsort(-np.abs(ranks[r]["before"]))[:k]
        exact[top] += ranks[r]["before"][top] / WORLD
    # each value is off by at most half a 4-bit step of the largest value it was sent with
    worst = max(np.abs(ranks[r]["before"]).max() for r in range(WORLD)) / 7 / 2
    assert np.abs(after - exact)[sent].max() <= worst * 1.001 + np.abs(exact).max() * 2.0 ** -8
    for r in range(WORLD):
        assert ranks[r]["bytes_sent"] == 4 * k + math.ceil(k / 2) + 4 * math.ceil(k / chunk)
        assert ranks[r]["bytes_sent"] < 0.6 * 8 * k  # under 60% of plain top-k's bytes


def test_topk_sends_one_percent_and_the_exact_mean_of_what_it_sent(ranks):
    ranks = ranks["topk"]
    k = math.ceil(0.01 * N)  # 191
    expected = np.zeros(N, dtype=np.float32)
    for r in range(WORLD):
        before = ranks[r]["before"]
        top = np.argsort(-np.abs(before))[:k]
        expected[top] += before[top]
    expected /= WORLD
    expected[-40 * 101:] = torch.from_numpy(expected[-40 * 101:]).bfloat16().float().numpy()
    for r in range(WORLD):
        np.testing.assert_array_equal(ranks[r]["after"], expected)
        assert ranks[r]["bytes_sent"] == k * (4 + 4)  # int32 index + fp32 value
        assert ranks[r]["bytes_uncompressed"] == 4 * N
    assert k <= np.count_nonzero(ranks[0]["after"]) <= WORLD * k


def test_error_feedback_keeps_topk_sgd_converging(ranks):
    out = ranks["regression"]
    losses = out[0]
    for name in ("plain", "ef", "no_ef"):  # the replicas took the same steps
        np.testing.assert_array_equal(out[0][name + "_w"], out[1][name + "_w"])
    assert losses["plain"] < 0.01 * losses["initial"], losses  # the problem is solved in 300 steps
    assert losses["ef"] < 1.5 * losses["plain"], losses  # top-k 1% with error feedback: as good
    assert losses["no_ef"] > 20 * losses["ef"], losses  # without: stalls far above (about 200x)


def test_overflowed_step_shows_in_the_mean_but_does_not_poison_later_steps(ranks):
    ranks = ranks["overflow"]
    for r in range(WORLD):
        first, overflowed, after = ranks[r]["means"]
        assert np.isfinite(first).all()
        assert not np.isfinite(overflowed).all()  # the trainer's overflow check sees it
        assert np.isfinite(after).all()  # the residual did not keep the NaN
        assert ranks[r]["residual_finite"]
        assert ranks[r]["positions"] == [0, 1, 2]
        np.testing.assert_array_equal(ranks[r]["restored"], ranks[r]["continued"])


def test_powersgd_recovers_a_low_rank_mean_and_carries_the_rest_to_the_next_step(ranks):
    ranks = ranks["powersgd"]
    exact = (ranks[0]["before"] + ranks[1]["before"]) / WORLD
    matrix = slice(0, 60 * 40)
    for r in range(WORLD):
        # rank 2 >= the mean's rank: the mean comes back (to fp32 rounding), for 4 (60 + 40) * 2
        # bytes of the matrix and the 7 + 15 uncompressed elements in full
        np.testing.assert_allclose(ranks[r]["rank2"], exact, rtol=1e-4, atol=1e-5)
        assert ranks[r]["rank2_bytes"] == 4 * ((60 + 40) * 2 + 7 + 15)
        assert ranks[r]["rank1_bytes"] == 4 * ((60 + 40) * 1 + 7 + 15)
        first, second = ranks[r]["rank1_first"], ranks[r]["rank1_second"]
        # rank 1 sends one direction of the two: the matrix's mean is off after the first step ...
        assert np.abs(first[matrix] - exact[matrix]).max() > 0.1 * np.abs(exact[matrix]).max()
        np.testing.assert_allclose(first[60 * 40:], exact[60 * 40:], rtol=1e-6)   # sent whole
        # ... what this rank left out is its residual, and the mean of the residuals is the rest ...
        residuals = [ranks[w]["rank1_residual"].reshape(-1) for w in range(WORLD)]
        np.testing.assert_allclose(first[matrix] + sum(residuals) / WORLD, exact[matrix], rtol=1e-4, atol=1e-5)
        # ... which the next step (no new gradient) delivers: the two steps add up to the mean
        np.testing.assert_allclose(first + second, exact, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(ranks[r]["restored_second"], second)   # residual and Q in the state
    np.testing.assert_array_equal(ranks[0]["rank2"], ranks[1]["rank2"])    # replicas stay identical
    np.testing.assert_array_equal(ranks[0]["rank1_second"], ranks[1]["rank1_second"])


def test_powersgd_overflowed_step_shows_in_the_mean_and_the_next_step_starts_its_basis_again(ranks):
    for r in range(WORLD):
        first, overflowed, after = ranks["powersgd_overflow"][r]["means"]
        assert np.isfinite(first).all()
        assert not np.isfinite(overflowed).all()    # the trainer's overflow check sees it
        assert np.isfinite(after).all() and np.abs(after).max() > 0   # neither Q nor the residual kept it


@pytest.mark.parametrize("rank", [0, 257, 1.5, True])
def test_powersgd_rank_outside_1_256_is_refused(rank):
    with pytest.raises(ValueError, match="compression rank must be an integer from 1 to 256, got"):
        GradientCompressor("powersgd", None, rank=rank)


@pytest.mark.parametrize("density", [0, 1.5, -1, float("nan")])
def test_density_outside_0_1_is_refused(density):
    with pytest.raises(ValueError, match=r"compression density must be in \(0, 1\], got") as e:
        GradientCompressor("topk", None, density=density)
    assert "\n" not in str(e.value)


def test_unknown_method_is_refused_naming_it_and_the_choices():
    with pytest.raises(ValueError) as e:
        GradientCompressor("fp8", None)
    message = str(e.value)
    assert "fp8" in message and all(m in message for m in METHODS) and "\n" not in message


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="compression chunk must be a positive integer, got 0"):
        GradientCompressor("int8", None, chunk=0)


if __name__ == "__compression_rank__":  # a rank process started by _spawn
    _rank_main(*globals()["RANK_JOB"])
