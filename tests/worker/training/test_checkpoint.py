"""Sharded checkpoints: written by real gloo ranks, read back in other layouts; commit protocol,
fallback, model mismatch; step-keyed training data."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import checkpoint_tiers as tiers
from shardwise.worker.training.data import DataError, StepBatches, TokenDataset

FULL_COL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)          # split along rows
FULL_ROW = torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10) * -1.0  # split along columns
VOCAB = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))      # 7 rows: uneven split
META = {"hidden_size": 8, "num_layers": 2}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_slices(rank: int, world: int, step: int) -> dict[str, ckpt.Slice]:
    """What rank `rank` of a TP group of `world` holds; values depend on the step."""
    col = FULL_COL.chunk(world, 0)[rank] + step
    row = FULL_ROW.chunk(world, 1)[rank] + step
    rows = -(-VOCAB.shape[0] // world)             # vocab-style: ceil parts, the last one short
    vocab = VOCAB[rank * rows:(rank + 1) * rows] + step
    return {
        "model/col": ckpt.Slice.split(col.clone(), FULL_COL.shape, rank, world),
        "model/row": ckpt.Slice.split(row.clone(), FULL_ROW.shape, rank, world),
        "model/vocab": ckpt.Slice(vocab.clone(), tuple(VOCAB.shape), (rank * rows, 0)),
        "model/norm": ckpt.Slice.whole(torch.full((3,), float(step))),
    }


def _saver(rank, world, port, root, steps, keep, asynchronous, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        manager = tiers.CheckpointManager(root, rank=rank, group=group, model_meta=META, keep=keep,
                                         asynchronous=asynchronous)
        blocking = []
        for step in steps:
            manager.save(step, _rank_slices(rank, world, step), {"data": {"step": step}})
            blocking.append(manager.last_blocking_s)
            if rank == 0 and asynchronous:
                # Right after save() returns the write may still be running: not yet visible.
                results.put(("visible_after_save", step, (ckpt.committed(root) or [(None,)])[-1][0] == step))
        manager.wait()
        dist.barrier()
        results.put(("ok", rank, blocking))
    finally:
        dist.destroy_process_group()


def _save_in_ranks(root, world=2, steps=(1, 2, 3), keep=2, asynchronous=True, env=None):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        port = _port()
        procs = [ctx.Process(target=_saver, args=(r, world, port, str(root), steps, keep, asynchronous, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert [p.exitcode for p in procs] == [0] * world
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def _load(root, wanted, meta=META):
    return tiers.CheckpointManager(root, rank=0, group=None, model_meta=meta).load_latest(wanted)


def test_saved_under_tp2_reads_back_whole_and_in_other_splits(tmp_path):
    _save_in_ranks(tmp_path, world=2, steps=(1, 2, 3), keep=2)
    assert [s for s, _ in ckpt.committed(tmp_path)] == [2, 3]   # keep-last-2 pruned step 1
    # One process, whole tensors (TP=1).
    whole = {k: torch.zeros(t.shape) for k, t in
             {"model/col": FULL_COL, "model/row": FULL_ROW, "model/vocab": VOCAB}.items()}
    meta = _load(tmp_path, {k: ckpt.Slice.whole(v) for k, v in whole.items()})
    assert meta["step"] == 3 and meta["data"] == {"step": 3}
    assert torch.equal(whole["model/col"], FULL_COL + 3)
    assert torch.equal(whole["model/row"], FULL_ROW + 3)
    assert torch.equal(whole["model/vocab"], VOCAB + 3)
    # Four ranks (TP=4): each reads its part, which straddles the two saved parts.
    for world in (4, 3):
        for rank in range(world):
            want = {k: ckpt.Slice(torch.zeros(s.tensor.shape), s.full_shape, s.offsets)
                    for k, s in _rank_slices(rank, world, 0).items()}
            _load(tmp_path, want)
            for k, s in _rank_slices(rank, world, 3).items():
                assert torch.equal(want[k].tensor, s.tensor), (world, rank, k)


def test_async_save_returns_before_the_write_is_committed(tmp_path):
    out = _save_in_ranks(tmp_path, world=2, steps=(5,), keep=3, asynchronous=True,
                         env={"SHARDWISE_CHECKPOINT_COMMIT_DELAY_S": "1.0"})
    visible = [r for r in out if r[0] == "visible_after_save"]
    assert visible == [("visible_after_save", 5, False)]
    blocking = [r[2][0] for r in out if r[0] == "ok"]
    assert max(blocking) < 0.5          # training waited for the copy, not the 1 s write
    assert [s for s, _ in ckpt.committed(tmp_path)] == [5]


def test_cut_off_and_damaged_checkpoints_are_never_loaded(tmp_path):
    _save_in_ranks(tmp_path, world=2, steps=(1, 2), keep=3)
    # A write cut off before its commit (no marker) and a temp folder: both invisible.
    (tmp_path / ".tmp-step-00000009").mkdir()
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / "__0_0.distcp").write_bytes(b"partial")
    assert [s for s, _ in ckpt.committed(tmp_path)] == [1, 2]
    # Damage the newest complete one: its shard file is cut short.
    shard = tmp_path / "step-00000002" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    col = torch.zeros(FULL_COL.shape)
    with pytest.warns(UserWarning, match="step-00000002.*falling back"):
        meta = _load(tmp_path, {"model/col": ckpt.Slice.whole(col)})
    assert meta["step"] == 1 and torch.equal(col, FULL_COL + 1)
    # Garbage of the right size (the marker's sizes still match): DCP's read fails, fallback too.
    ckpt_file = tmp_path / "step-00000002" / "__0_0.distcp"
    size = ckpt_file.stat().st_size
    shard.write_bytes(b"\0" * json.loads((tmp_path / "step-00000002" / "COMPLETE").read_text())["files"]["__1_0.distcp"])
    ckpt_file.write_bytes(os.urandom(size))
    with pytest.warns(UserWarning, match="falling back"):
        assert _load(tmp_path, {"model/col": ckpt.Slice.whole(col)})["step"] == 1
    # A new manager on rank 0 clears the leftovers of cut-off writes: the final-named folder without
    # a marker at once, another run's temp folder only once nothing in it was written for the bound.
    tiers.CheckpointManager(tmp_path, rank=0, group=None, model_meta=META)
    assert (tmp_path / ".tmp-step-00000009").exists() and not (tmp_path / "step-00000008").exists()
    old = time.time() - ckpt.STALE_TEMP_S - 60
    os.utime(tmp_path / ".tmp-step-00000009", (old, old))
    tiers.CheckpointManager(tmp_path, rank=0, group=None, model_meta=META)
    assert not (tmp_path / ".tmp-step-00000009").exists()


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    """CheckpointMismatch, the type load_latest stops on (a damaged checkpoint is skipped instead)."""
    _save_in_ranks(tmp_path, world=2, steps=(1,), keep=3)
    with pytest.raises(ckpt.CheckpointMismatch, match=r"different model: hidden_size=8 \(this model: 16\)"):
        _load(tmp_path, {"model/col": ckpt.Slice.whole(torch.zeros(8, 6))}, meta={**META, "hidden_size": 16})
    with pytest.raises(ckpt.CheckpointMismatch, match=r"'model/col' has shape \(8, 6\).*\(5, 6\).*different model"):
        _load(tmp_path, {"model/col": ckpt.Slice.whole(torch.zeros(5, 6))})
    with pytest.raises(ckpt.CheckpointMismatch, match="no tensor 'model/missing'.*different model"):
        _load(tmp_path, {"model/missing": ckpt.Slice.whole(torch.zeros(2))})


# ---------------------------------------------------------------- data

def _chars(text: str) -> list[int]:
    return [ord(c) % 97 for c in text]


def test_batches_are_a_function_of_step_and_split_across_replicas(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    data = TokenDataset.from_file(f, _chars)
    a = StepBatches(data, seq_len=16, batch_size=8, seed=3)
    b = StepBatches(data, seq_len=16, batch_size=8, seed=3)
    full = a.batch(5)
    assert full.shape == (8, 17)
    # Any replica count sees the same global batch, and asking out of order changes nothing.
    b.batch(40)
    for replicas in (2, 4):
        parts = [b.batch(5, r, replicas) for r in range(replicas)]
        assert torch.equal(torch.cat(parts), full)
    assert not torch.equal(a.batch(6), full)
    assert not torch.equal(StepBatches(data, 16, 8, seed=4).batch(5), full)
    # One epoch visits every window exactly once.
    windows = [w for s in range(1, a.num_windows // 8 + 1) for w in a.window_ids(s)]
    assert len(set(windows)) == len(windows)


@pytest.mark.parametrize("content,message", [
    (b"", "is empty"), (b"  \n\t ", "is empty"), (b"\xff\xfe\x00bad", "not UTF-8"), (None, "cannot be read")])
def test_unusable_dataset_is_a_clear_error(tmp_path, content, message):
    f = tmp_path / "d.txt"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        TokenDataset.from_file(f, _chars)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_dataset_shorter_than_one_sequence_is_a_clear_error(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("short text")
    with pytest.raises(DataError, match="fewer than one sequence of --seq-len 64"):
        StepBatches(TokenDataset.from_file(f, _chars), 64, 2, 0)
