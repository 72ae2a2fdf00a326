"""Two runs writing one checkpoint directory (a pod force-deleted while still writing, and its
replacement): real gloo ranks, real files. Neither run deletes the other's in-flight data, the
step ends committed exactly once and whole, and a commit never replaces a complete checkpoint."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import checkpoint_tiers as tiers

STEP = 5
FULL = {"model/col": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),
        "model/row": torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10)}
META = {"hidden_size": 8}
OFFSET = {"A": 100.0, "B": 200.0}   # each run's values, so the committed copy tells whose it is


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slices(run: str, rank: int, world: int) -> dict[str, ckpt.Slice]:
    return {"model/col": ckpt.Slice.split(FULL["model/col"].chunk(world, 0)[rank] + OFFSET[run],
                                          FULL["model/col"].shape, rank, world),
            "model/row": ckpt.Slice.split(FULL["model/row"].chunk(world, 1)[rank] + OFFSET[run],
                                          FULL["model/row"].shape, rank, world)}


def _rank(run: str, rank: int, world: int, port: int, root: str, delay: str) -> None:
    """One rank of one run: agree on the attempt, save STEP, exit 0 only if the write succeeded."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if delay:
        os.environ["SHARDWISE_CHECKPOINT_COMMIT_DELAY_S"] = delay
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        manager = tiers.CheckpointManager(root, rank=rank, group=group, model_meta=META, keep=3,
                                         asynchronous=False)
        manager.save(STEP, _slices(run, rank, world), {"run": run})
        manager.wait()   # raises if this run's write failed
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _start(run: str, root: Path, delay: str = "", world: int = 2) -> list[mp.Process]:
    ctx = mp.get_context("fork")
    port = _port()
    procs = [ctx.Process(target=_rank, args=(run, r, world, port, str(root), delay)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def _join(procs: list[mp.Process]) -> list[int | None]:
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def _temp_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(".tmp-"))


def test_two_runs_writing_one_step_leave_one_whole_checkpoint(tmp_path):
    # Run A writes step 5 and then waits 10 s before its commit: its data is on disk, uncommitted.
    a = _start("A", tmp_path, delay=f"{STEP}:10")
    deadline = time.time() + 90
    while not [t for t in (_temp_dirs(tmp_path) if tmp_path.is_dir() else []) if (t / ".metadata").exists()]:
        assert time.time() < deadline and all(p.is_alive() for p in a), "run A never wrote its step"
        time.sleep(0.05)
    (a_tmp,) = _temp_dirs(tmp_path)
    a_files = {p.name: p.stat().st_size for p in a_tmp.iterdir()}
    # Run B starts in the same directory (its rank 0 clears leftovers), writes the same step, commits.
    assert _join(_start("B", tmp_path)) == [0, 0]
    assert all(p.is_alive() for p in a), "run A finished before run B: the runs did not overlap"
    # B's start and B's commit left A's in-flight folder alone, every file of it.
    assert a_tmp.is_dir() and {p.name: p.stat().st_size for p in a_tmp.iterdir()} == a_files
    assert [s for s, _ in ckpt.committed(tmp_path)] == [STEP]
    # A commits after B: its write succeeds, and B's committed step is not replaced.
    assert _join(a) == [0, 0]
    assert [s for s, _ in ckpt.committed(tmp_path)] == [STEP]
    assert _temp_dirs(tmp_path) == [] and not [p for p in tmp_path.iterdir() if p.name.startswith(".del-")]
    folder = tmp_path / ckpt.step_dir_name(STEP)
    meta = ckpt.verify(folder)
    assert meta["run"] == "B"
    whole = {k: torch.zeros(t.shape) for k, t in FULL.items()}
    ckpt.read_slices(folder, {k: ckpt.Slice.whole(v) for k, v in whole.items()})
    for k, t in FULL.items():   # every tensor, every rank's part, from the one run
        assert torch.equal(whole[k], t + OFFSET["B"]), k


def _save_one(root: Path, run: str) -> tiers.CheckpointManager:
    manager = tiers.CheckpointManager(root, rank=0, group=None, model_meta=META, asynchronous=False)
    manager.save(STEP, _slices(run, 0, 1), {"run": run})
    manager.wait()
    return manager


def test_a_commit_replaces_only_a_damaged_checkpoint_of_its_step(tmp_path):
    _save_one(tmp_path, "A")
    folder = tmp_path / ckpt.step_dir_name(STEP)
    _save_one(tmp_path, "B")                      # complete already: the later copy is dropped
    assert ckpt.verify(folder)["run"] == "A" and _temp_dirs(tmp_path) == []
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])    # damaged (say, a copy cut short before a crash)
    _save_one(tmp_path, "B")
    assert ckpt.verify(folder)["run"] == "B"
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_only_this_attempts_and_stale_temp_folders_are_cleared(tmp_path):
    mine, live, stale = (ckpt.temp_dir(tmp_path, STEP, a) for a in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"))
    for d in (mine, live, stale):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 10)
    old = time.time() - ckpt.STALE_TEMP_S - 60
    for p in (stale, stale / "__0_0.distcp"):
        os.utime(p, (old, old))
    # A folder whose own mtime is old but whose file is still being written is live too.
    os.utime(live, (old, old))
    removed = ckpt.clean_partial(tmp_path, "aaaaaaaaaaaa")
    assert sorted(removed) == sorted([mine, stale])
    assert [p.name for p in tmp_path.iterdir()] == [live.name]
    assert ckpt.TEMP_DIR.match(live.name).groups() == (f"{STEP:08d}", "bbbbbbbbbbbb")
