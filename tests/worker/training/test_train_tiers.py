"""Checkpoint tiers and preemption, end to end: `shardwise train` as real local processes (gloo).

The local tier (--local-checkpoint-every 2) sits between shared checkpoints (--checkpoint-every 6):
a crashed run resumes from the newest local step every rank still has, when it is newer than the
shared one and was saved in the same layout; otherwise from the shared tier. SIGTERM stops every
rank at one step with a shared checkpoint. Every resumed run must reproduce the uninterrupted
run's losses (fp32, 1e-3)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training.checkpoint_tiers import LOCAL_STATE


STEPS, SHARED, LOCAL = 12, 6, 2
COMMON = ["--steps", str(STEPS), "--checkpoint-every", str(SHARED), "--local-checkpoint-every", str(LOCAL),
          "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3", "--seed", "7", "--json"]
RTOL = 1e-3
DELAY = "SHARDWISE_CHECKPOINT_COMMIT_DELAY_S"


def _tier(local: Path) -> list[str]:
    return ["--local-checkpoint-dir", str(local)]


def _local_steps(local: Path, rank: int) -> list[int]:
    return [s for s, _ in ckpt.committed(local / f"rank-{rank}")]


def _assert_same_losses(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=RTOL), f"step {s}: {got[s]} vs {want[s]}"


@pytest.fixture(scope="module")
def reference(work, train):
    """The uninterrupted run under TP=2, both tiers on."""
    code, recs, err = train.run(work / "ref", *_tier(work / "ref-local"), "--tensor-parallel", "2")
    assert code == 0, err
    assert sorted(recs) == list(range(1, STEPS + 1))
    tiers = {s: r["checkpoint_tier"] for s, r in recs.items() if "checkpoint_tier" in r}
    assert tiers == {2: "local", 4: "local", 6: "shared", 8: "local", 10: "local", 12: "shared"}
    assert all(r["checkpoint_blocking_s"] >= 0 for s, r in recs.items() if s in tiers)
    for rank in (0, 1):    # keep 2 per rank; shared steps are not saved locally
        assert _local_steps(work / "ref-local", rank) == [8, 10]
    return recs


@pytest.fixture(scope="module")
def crashed(work, train, reference):
    """A TP=2 run whose rank 1 is killed (-9) at step ~9: local tier at 8, shared at 6. Step 10's
    local commit is held back, so wherever the kill lands, 8 is the newest complete local step."""
    ckdir, local = work / "crash", work / "crash-local"
    proc = train.start(ckdir, *_tier(local), "--tensor-parallel", "2", env={DELAY: "10:60"})
    seen = {}
    for line in proc.stdout:
        rec = json.loads(line)
        seen[rec["step"]] = rec
        if rec["step"] >= 9 and all(_local_steps(local, r)[-1:] == [8] for r in (0, 1)):
            os.kill(train.ranks(proc.pid)[1], signal.SIGKILL)
            break
    proc.stdout.read()
    assert proc.wait(60) != 0
    assert "rank 1 was killed by signal 9" in proc.stderr.read()
    assert [s for s, _ in ckpt.committed(ckdir)] == [SHARED]
    _assert_same_losses(seen, reference, seen)
    return ckdir, local


def _copy(crashed, dst: Path) -> tuple[Path, Path]:
    ckdir, local = crashed
    shutil.copytree(ckdir, dst / "ck")
    shutil.copytree(local, dst / "local")
    return dst / "ck", dst / "local"


def test_killed_run_resumes_from_the_newer_local_checkpoint(train, reference, crashed, tmp_path):
    ckdir, local = _copy(crashed, tmp_path)
    code, got, err = train.run(ckdir, *_tier(local), "--tensor-parallel", "2")
    assert code == 0, err
    assert "resumed from local checkpoint step 8 (TP=2 PP=1 DP=1" in err and "shared checkpoint: step 6" in err
    assert sorted(got) == list(range(9, STEPS + 1))            # not from shared step 6
    _assert_same_losses(got, reference, range(9, STEPS + 1))
    progress = json.loads((ckdir / "progress.json").read_text())
    assert progress["resumed_from"] == {"tier": "local", "step": 8}
    assert progress["last_local_checkpoint"]["step"] == 10 and progress["last_checkpoint"]["step"] == STEPS


@pytest.mark.parametrize("lost", ["all", "rank-1"], ids=["local-dir-deleted", "one-rank-local-dir-deleted"])
def test_lost_local_tier_resumes_from_the_shared_checkpoint(train, reference, crashed, tmp_path, lost):
    """The node's disk is gone (all of it, or only rank 1's): the ranks agree on a local step every
    one of them has, and none is newer than shared step 6 (rank 0 alone still holds step 8)."""
    ckdir, local = _copy(crashed, tmp_path)
    shutil.rmtree(local if lost == "all" else local / "rank-1")
    code, got, err = train.run(ckdir, *_tier(local), "--tensor-parallel", "2")
    assert code == 0, err
    assert "resumed from checkpoint step 6 (saved under TP=2 PP=1 DP=1, now TP=2 PP=1 DP=1)" in err
    _assert_same_losses(got, reference, range(7, STEPS + 1))
    assert sorted(got) == list(range(7, STEPS + 1))


def test_resume_in_another_layout_ignores_the_local_tier(train, reference, crashed, tmp_path):
    ckdir, local = _copy(crashed, tmp_path)
    code, got, err = train.run(ckdir, *_tier(local), "--data-parallel", "2")
    assert code == 0, err
    assert "resumed from checkpoint step 6 (saved under TP=2 PP=1 DP=1, now TP=1 PP=1 DP=2" in err
    assert "local checkpoint" not in err
    _assert_same_losses(got, reference, range(7, STEPS + 1))


def test_killed_mid_local_save_loses_nothing_before_the_last_complete_local_checkpoint(train, reference, tmp_path):
    ckdir, local = tmp_path / "ck", tmp_path / "local"
    proc = train.start(ckdir, *_tier(local), "--tensor-parallel", "2", env={DELAY: "10:60"})
    deadline = time.time() + 120
    while not list((local / "rank-0").glob(f".tmp-step-00000010-*/{LOCAL_STATE}")):   # written, commit pending
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    (tmp,) = (local / "rank-0").glob(".tmp-step-00000010-*")
    os.kill(train.ranks(proc.pid)[0], signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert _local_steps(local, 0) == [4, 8] and tmp.exists()     # the cut-off step 10 is not visible
    old = time.time() - ckpt.STALE_TEMP_S - 60                  # the killed run's folder, past the bound
    for p in (tmp, *tmp.iterdir()):
        os.utime(p, (old, old))
    code, got, err = train.run(ckdir, *_tier(local), "--tensor-parallel", "2")
    assert code == 0, err
    assert "resumed from local checkpoint step 8" in err
    assert not tmp.exists()                                      # leftovers cleaned
    _assert_same_losses(got, reference, range(9, STEPS + 1))


def test_sigterm_stops_every_rank_at_one_step_with_a_shared_checkpoint(train, reference, tmp_path):
    ckdir, local = tmp_path / "ck", tmp_path / "local"
    proc = train.start(ckdir, *_tier(local), "--tensor-parallel", "2")
    seen = {}
    for line in proc.stdout:
        rec = json.loads(line)
        seen[rec["step"]] = rec
        if rec["step"] == 3:
            proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(60) == 143, err
    stop = max(seen)
    assert 3 <= stop < STEPS
    name = ckpt.step_dir_name(stop)
    assert f"stopping at step {stop}: checkpoint {name} saved" in err
    assert seen[stop]["checkpoint_tier"] == "shared" and seen[stop]["checkpoint"] == name
    assert stop in [s for s, _ in ckpt.committed(ckdir)]
    progress = json.loads((ckdir / "progress.json").read_text())
    assert progress["step"] == stop and progress["last_checkpoint"]["step"] == stop and not progress["done"]
    _assert_same_losses(seen, reference, seen)
    code, got, err = train.run(ckdir, *_tier(local), "--tensor-parallel", "2")
    assert code == 0, err
    assert f"resumed from checkpoint step {stop} " in err
    assert sorted(got) == list(range(stop + 1, STEPS + 1))
    _assert_same_losses(got, reference, got)


def test_a_local_directory_that_cannot_be_written_is_one_line(train, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    p = subprocess.run(train.command(tmp_path / "ck", *_tier(blocker / "local")), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == f"shardwise train: --local-checkpoint-dir {blocker / 'local'} is not writable: Not a directory"
    p = subprocess.run(train.command(tmp_path / "ck"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2     # an interval without a directory
    assert p.stderr.strip() == ("shardwise train: --local-checkpoint-dir and --local-checkpoint-every K (K >= 1) "
                                "go together")


# ---------------------------------------------------------------- a training pod

def _contract(tmp_path: Path, work: Path, port: int, local_path: Path, steps: int) -> str:
    from shardwise.crds.contract import ModelContract, PodContract, ServingContract
    from shardwise.crds.models import Checkpoint, LocalCheckpoint, Training
    from shardwise.crds.plan import ShardPlan, StagePlacement
    plan = ShardPlan(tensor=1, pipeline=1, replicas=1, num_layers=4, placements=[
        StagePlacement(replica=0, stage=0, node="n", gpus=1, layer_start=0, layer_end=4, embedding=True, head=True)])
    checkpoint = Checkpoint(claim="c", path=str(tmp_path / "ck"), interval_steps=1000,
                            local=LocalCheckpoint(path=str(local_path), interval_steps=2, keep=2))
    path = tmp_path / "contract.json"
    path.write_text(PodContract(
        plan=plan, model=ModelContract(path=str(work / "model"), format="auto", dtype="auto"), workload="training",
        serving=ServingContract(port=port, model_name="tiny"),
        training=Training(data=str(work / "data.txt"), steps=steps, batch_size=4, seq_length=32),
        checkpoint=checkpoint, termination_log=str(tmp_path / "termination")).to_json())
    return str(path)


def _pod_env() -> dict:
    return {**os.environ, "POD_IP": "127.0.0.1", "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_training_pod_forwards_sigterm_and_its_ranks_save_before_exiting(train, work, tmp_path):
    """The pod parent passes SIGTERM on to its ranks and waits: they stop at one step with a shared
    checkpoint and the pod exits 143 (not finished). The local tier comes from the contract."""
    contract = _contract(tmp_path, work, _free_port(), tmp_path / "local", 100000)
    pod = subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
                           env=_pod_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _local_steps(tmp_path / "local", 0) and time.monotonic() < deadline:
        assert pod.poll() is None, pod.communicate()[1]
        time.sleep(0.2)
    pod.send_signal(signal.SIGTERM)
    out, err = pod.communicate(timeout=120)
    assert pod.returncode == 143, err
    stop = max(train.records(out))
    assert f"stopping at step {stop}: checkpoint {ckpt.step_dir_name(stop)} saved" in err
    assert [s for s, _ in ckpt.committed(tmp_path / "ck")] == [stop]
    progress = json.loads((tmp_path / "ck" / "progress.json").read_text())
    assert progress["last_checkpoint"]["step"] == stop and progress["last_local_checkpoint"]["step"] >= 2


def test_a_training_pod_with_an_unwritable_local_path_names_the_spec_field(work, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    contract = _contract(tmp_path, work, _free_port(), blocker / "local", 4)
    p = subprocess.run([sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
                       env=_pod_env(), capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr
    assert last == f"shardwise worker: error: checkpoint.local.path {blocker / 'local'} is not writable: Not a directory"
    assert "Traceback" not in p.stderr
