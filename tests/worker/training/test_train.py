"""`shardwise train` end to end: real local processes talking gloo, real checkpoints on disk.

One uninterrupted reference run (TP=2) is the yardstick: runs resumed in other layouts, runs
whose ranks are killed mid-step or mid-save, must reproduce its per-step losses (fp32, 1e-3)."""
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
import torch

from shardwise.worker.training import checkpoint as ckpt

STEPS, EVERY = 16, 4
COMMON = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--batch-size", "4", "--seq-len", "32",
          "--lr", "3e-3", "--seed", "7", "--json"]
RTOL = 1e-3


@pytest.fixture(scope="module")
def reference(work, train):
    """The uninterrupted run under TP=2: its records (step -> loss...) and its checkpoints."""
    ckdir = work / "ref"
    code, recs, err = train.run(ckdir, "--tensor-parallel", "2")
    assert code == 0, err
    assert sorted(recs) == list(range(1, STEPS + 1))
    assert recs[STEPS]["loss"] < recs[1]["loss"]            # it learns
    return recs, ckdir


def _assert_same_losses(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for s in steps:
        g, w = got[s]["loss"], want[s]["loss"]
        assert g == pytest.approx(w, rel=RTOL), f"step {s}: {g} vs {w}"


def _resume_copy(ref_dir: Path, step: int, dst: Path) -> Path:
    dst.mkdir()
    shutil.copytree(ref_dir / ckpt.step_dir_name(step), dst / ckpt.step_dir_name(step))
    return dst


@pytest.mark.parametrize("layout", [("--pipeline-parallel", "2"), ("--data-parallel", "2")],
                         ids=["TP1xPP2", "PP1xDP2"])
def test_resume_tp2_checkpoint_in_another_layout_matches_uninterrupted_losses(reference, train, tmp_path, layout):
    want, ref_dir = reference
    ckdir = _resume_copy(ref_dir, 8, tmp_path / "ck")
    code, got, err = train.run(ckdir, *layout)
    assert code == 0, err
    assert "resumed from checkpoint step 8 (saved under TP=2 PP=1 DP=1" in err
    assert sorted(got) == list(range(9, STEPS + 1))          # no step is done twice
    _assert_same_losses(got, want, range(9, STEPS + 1))
    assert [s for s, _ in ckpt.committed(ckdir)] == [8, 12, 16]


def test_rank_killed_mid_run_restarts_from_last_complete_checkpoint(reference, train, tmp_path):
    want, _ = reference
    ckdir = tmp_path / "ck"
    # Step 8's commit is held back (slow storage), so the kill lands while 4 is the last complete
    # checkpoint and training is somewhere between steps 6 and 12.
    proc = train.start(ckdir, "--pipeline-parallel", "2", env={"SHARDWISE_CHECKPOINT_COMMIT_DELAY_S": "8:10"})
    seen = {}
    for line in proc.stdout:
        rec = json.loads(line)
        seen[rec["step"]] = rec
        if rec["step"] >= 6 and ckpt.committed(ckdir):
            os.kill(train.ranks(proc.pid)[1], signal.SIGKILL)     # the last stage dies
            break
    proc.stdout.read()
    assert proc.wait(60) != 0
    assert "rank 1 was killed by signal 9" in proc.stderr.read()
    done = [s for s, _ in ckpt.committed(ckdir)]
    assert done == [4]
    _assert_same_losses(seen, want, seen)
    # Restart in another layout: resumes exactly at the last complete checkpoint.
    code, got, err = train.run(ckdir, "--tensor-parallel", "2")
    assert code == 0, err
    assert f"resumed from checkpoint step {max(done)}" in err
    assert sorted(got) == list(range(max(done) + 1, STEPS + 1))
    _assert_same_losses(got, want, got)


def test_rank_killed_mid_save_never_loads_the_cut_off_checkpoint(reference, train, tmp_path):
    want, _ = reference
    ckdir = tmp_path / "ck"
    proc = train.start(ckdir, "--tensor-parallel", "2", env={"SHARDWISE_CHECKPOINT_COMMIT_DELAY_S": "8:60"})
    deadline = time.time() + 120
    while not list(ckdir.glob(".tmp-step-00000008-*/.metadata")):   # every rank's data written, commit pending
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    (tmp,) = ckdir.glob(".tmp-step-00000008-*")
    os.kill(train.ranks(proc.pid)[0], signal.SIGKILL)   # rank 0: the one that commits
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert [s for s, _ in ckpt.committed(ckdir)] == [4]     # the cut-off step 8 is not visible
    old = time.time() - ckpt.STALE_TEMP_S - 60             # the killed run's folder, untouched past the bound
    for p in (tmp, *tmp.iterdir()):
        os.utime(p, (old, old))
    code, got, err = train.run(ckdir, "--data-parallel", "2")
    assert code == 0, err
    assert "resumed from checkpoint step 4" in err
    assert not tmp.exists()                                 # leftovers cleaned
    _assert_same_losses(got, want, range(5, STEPS + 1))


def _greedy_reference(ckdir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the trained weights, read whole from the checkpoint into the plain model
    and decoded with full causal forwards (no cache, no parallelism, no loader)."""
    from shardwise.worker.model.llama import ModelConfig, Transformer
    folder, meta = ckpt.resolve(ckdir)
    model = Transformer(ModelConfig.from_dict(meta["model_config"]))
    shapes = ckpt.stored_shapes(folder)
    state = {k: torch.empty(shapes["model/" + k]) for k in model.state_dict()}
    ckpt.read_slices(folder, {"model/" + k: ckpt.Slice.whole(v) for k, v in state.items()})
    model.load_state_dict(state)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def _greedy_base(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from shardwise.worker.weights.loader import load_stage, open_model
    source = open_model(str(model_dir))
    model = load_stage(source, 0, source.config.num_layers, True, True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_generate_from_training_checkpoint_gives_trained_greedy_tokens(work, reference):
    _, ref_dir = reference
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", str(ref_dir),
                        "--tensor-parallel", "2", "--prompt", "the quick brown", "--max-new-tokens", "8",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    trained = _greedy_reference(ref_dir, out["prompt_token_ids"], 8)
    assert out["token_ids"] == trained
    assert _greedy_base(work / "model", out["prompt_token_ids"], 8) != trained   # training changed it


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(reference, train, tmp_path):
    want, ref_dir = reference
    ckdir = tmp_path / "ck"
    shutil.copytree(ref_dir, ckdir)
    shard = ckdir / "step-00000016" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, got, err = train.run(ckdir, "--tensor-parallel", "2")
    assert code == 0, err
    assert "warning: checkpoint" in err and "step-00000016" in err and "falling back" in err
    assert "resumed from checkpoint step 12" in err
    _assert_same_losses(got, want, range(13, STEPS + 1))


def test_bad_input_is_one_clear_line(work, train, tiny_model, reference, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (["--data", str(empty)], f"dataset {empty} is empty"),
        (["--tensor-parallel", "3"], "tensor parallel degree 3 does not divide"),
    ]
    for extra, message in cases:
        p = subprocess.run(train.command(tmp_path / "ck", *extra), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (extra, p.stderr)
        assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # The same checks, in process (they run before any rank starts).
    from shardwise.worker.cli.train import check_inputs
    from shardwise.worker.training.data import DataError
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.training.trainer import TrainOptions
    base = dict(model=str(work / "model"), data=str(work / "data.txt"), checkpoint_dir=str(tmp_path / "ck"), steps=2)
    for change, error, message in [
        ({"data": str(tmp_path / "missing.txt")}, DataError, "missing.txt cannot be read"),
        ({"data": str(tmp_path)}, DataError, "is a directory"),
        ({"batch_size": 3, "data_parallel": 2}, WorkerError, "batch size 3 does not split evenly into 2 data-parallel replicas"),
        ({"pipeline": 5}, WorkerError, "pipeline parallel degree 5 is more stages than the model's 4 layers"),
        ({"model": str(tmp_path / "nope")}, WorkerError, "not found"),
    ]:
        with pytest.raises(error, match=message):
            check_inputs(TrainOptions(**{**base, **change}))
    # A checkpoint directory written for another model.
    other = tmp_path / "other"
    tiny_model(other, layers=2, hidden=32, heads=4, kv_heads=2)
    p = subprocess.run(train.command(reference[1], model=other), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "was written for a different model" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def _training_contract(path: Path, plan, model, port: int, termination_log: Path, data, checkpoint_dir,
                       steps: int, **training) -> str:
    """A training pod's contract file, as the operator would write it (options in the spec's names)."""
    from shardwise.crds.contract import ModelContract, PodContract, ServingContract
    from shardwise.crds.models import Checkpoint, Training
    checkpoint = Checkpoint(path=str(checkpoint_dir), interval_steps=training.pop("interval_steps", 100))
    path.write_text(PodContract(
        plan=plan, model=ModelContract(path=str(model), format="auto", dtype="auto"), workload="training",
        serving=ServingContract(port=port, model_name="tiny"),
        training=Training(data=str(data), steps=steps, **training), checkpoint=checkpoint,
        termination_log=str(termination_log)).to_json())
    return str(path)


def _one_stage_plan():
    from shardwise.crds.plan import ShardPlan, StagePlacement
    return ShardPlan(tensor=1, pipeline=1, replicas=1, num_layers=4, placements=[
        StagePlacement(replica=0, stage=0, node="n", gpus=1, layer_start=0, layer_end=4, embedding=True, head=True)])


def test_options_from_the_contract_are_the_specs():
    """The one mapping from spec.training and spec.checkpoint (in the contract) to TrainOptions."""
    from shardwise.crds.contract import PodContract
    from shardwise.crds.models import ShardedModel, ShardedModelSpec
    from shardwise.operator.render.renderer import configmap_contract, render_configmap
    from shardwise.worker.training.trainer import options_from_contract
    plan = _one_stage_plan()
    spec = ShardedModelSpec.model_validate({
        "model": {"uri": "/m"}, "workload": "training", "checkpoint": {"claim": "c", "intervalSteps": 5, "keep": 2},
        "training": {"data": "pvc://d/x.txt", "steps": 9, "batchSize": 6, "seqLength": 16, "learningRate": 0.01,
                     "warmupSteps": 3, "weightDecay": 0.1, "seed": 4, "microBatches": 2}})
    cm = render_configmap(ShardedModel(metadata={"name": "t", "namespace": "n", "uid": "u"}, spec=spec), plan)
    opts = options_from_contract(PodContract.from_json(configmap_contract(cm)), device="cpu", dtype="float32")
    assert (opts.model, opts.data, opts.checkpoint_dir, opts.steps) == ("/m", "/data/d/x.txt", "/checkpoints", 9)
    assert (opts.checkpoint_every, opts.keep, opts.batch_size, opts.seq_len) == (5, 2, 6, 16)
    assert (opts.lr, opts.warmup, opts.weight_decay, opts.seed, opts.micro_batches) == (0.01, 3, 0.1, 4, 2)
    assert (opts.tensor, opts.pipeline, opts.data_parallel, opts.stage_layers) == (1, 1, 1, [(0, 4)])
    assert (opts.device, opts.dtype, opts.json) == ("cpu", "float32", True)


def test_training_pods_from_a_plan_reproduce_the_reference(work, train, reference, tmp_path):
    """What a training ShardedModel's pods run: `shardwise worker` with a training contract: layout
    and (uneven) layer split from the plan, options from the contract, one world over all the pods
    of both replicas (data parallel). The losses match the reference run; each pod serves /healthz
    and /progress while it trains and leaves the result as its termination message."""
    import urllib.request
    from shardwise.crds.plan import ShardPlan, StagePlacement
    want, _ = reference
    plan = ShardPlan(tensor=1, pipeline=2, replicas=2, num_layers=4, placements=[
        StagePlacement(replica=r, stage=s, node=f"node-{r}-{s}", gpus=1, layer_start=(0, 3)[s],
                       layer_end=(3, 4)[s], embedding=s == 0, head=s == 1) for r in range(2) for s in range(2)])
    steps = 6
    env = {**os.environ, "POD_IP": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    ports = [_free_port() for _ in range(4)]
    pods = []
    for (r, s), port in zip([(0, 0), (0, 1), (1, 0), (1, 1)], ports):
        # Each pod its own copy of the contract (as local nodes give each): its port, its termination log.
        contract = _training_contract(
            tmp_path / f"contract-{r}-{s}.json", plan, work / "model", port, tmp_path / f"termination-{r}-{s}",
            work / "data.txt", tmp_path / "ck", steps, interval_steps=2, learning_rate=3e-3, seed=7, batch_size=4,
            seq_length=32)
        pod_env = {**env, "SHARDWISE_REPLICA": str(r), "SHARDWISE_STAGE": str(s)}
        pods.append(subprocess.Popen(
            [sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
            env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    seen, sent = [], []
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in pods) and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/progress", timeout=2) as resp:
                seen.append(json.loads(resp.read())["step"])
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/metrics", timeout=2) as resp:
                sent += [float(line.split()[-1]) for line in resp.read().decode().splitlines()
                         if line.startswith('shardwise_train_replicate_bytes_total{compression="none"}')]
        except OSError:
            pass
        time.sleep(0.2)
    outs = [p.communicate(timeout=60) for p in pods]
    assert [p.returncode for p in pods] == [0, 0, 0, 0], "\n".join(o[1][-2000:] for o in outs)
    got = train.records(outs[0][0])     # global rank 0 (replica 0, stage 0) reports the steps
    assert sorted(got) == list(range(1, steps + 1))
    _assert_same_losses(got, want, got)
    assert seen and max(seen) >= 1     # progress was readable from another pod while it trained
    assert sent and max(sent) > 0      # the gradient bytes averaged between the two replicas, as a metric
    for r, s in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        result = json.loads((tmp_path / f"termination-{r}-{s}").read_text())
        assert result["done"] and result["step"] == steps
        assert result["last_checkpoint"]["step"] == steps and result["last_checkpoint"]["name"] == "step-00000006"
    from shardwise.worker.training.progress import last_checkpoint
    assert last_checkpoint(str(tmp_path / "ck"))["step"] == steps


def test_a_training_pod_with_a_bad_dataset_fails_in_one_line_before_starting_ranks(work, tmp_path):
    """The pod's last log line is what the operator quotes as the job's failure."""
    (tmp_path / "empty.txt").write_text("")
    env = {**os.environ, "POD_IP": "127.0.0.1", "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for data, words in ((tmp_path / "missing.txt", "missing.txt"), (tmp_path / "empty.txt", "is empty")):
        contract = _training_contract(tmp_path / "contract.json", _one_stage_plan(), work / "model", _free_port(),
                                      tmp_path / "termination", data, tmp_path / "ck", 4)
        p = subprocess.run([sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
                           env=env, capture_output=True, text=True, timeout=120)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and last.startswith("shardwise worker: error: ") and words in last, p.stderr
        assert "Traceback" not in p.stderr


def test_a_training_pod_stopped_before_the_end_does_not_exit_zero(work, tmp_path):
    """SIGTERM (pod deleted, node drained) mid-run: the pod must not look finished (exit 0 would be
    Succeeded, and the job would end early)."""
    contract = _training_contract(tmp_path / "contract.json", _one_stage_plan(), work / "model", _free_port(),
                                  tmp_path / "termination", work / "data.txt", tmp_path / "ck", 100000,
                                  batch_size=4, seq_length=32)
    env = {**os.environ, "POD_IP": "127.0.0.1", "SHARDWISE_REPLICA": "0", "SHARDWISE_STAGE": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    pod = subprocess.Popen([sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ck" / "progress.json").exists() and time.monotonic() < deadline:
        assert pod.poll() is None, pod.communicate()[1]
        time.sleep(0.2)
    pod.send_signal(signal.SIGTERM)
    pod.communicate(timeout=60)
    assert pod.returncode not in (0, None)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tied_embedding_split_across_stages_trains_like_one_process(train, tiny_model, tmp_path):
    """A tied embedding/head (SmolLM2, Llama 3.2) lives on the first and the last stage under
    PP=2; its two gradients are summed so both copies stay one weight, and the checkpoint holds it
    once."""
    tied = tiny_model(tmp_path / "tied", layers=2, hidden=64, heads=4, kv_heads=2, tie=True)
    runs = {}
    for name, layout in (("one", ()), ("pp", ("--pipeline-parallel", "2"))):
        code, runs[name], err = train.run(tmp_path / name, *layout, "--steps", "4", model=tied)
        assert code == 0, err
    _assert_same_losses(runs["pp"], runs["one"], range(1, 5))
    stored = ckpt.stored_shapes(ckpt.committed(tmp_path / "pp")[-1][1])
    assert "model/tok_embeddings.weight" in stored and "model/output.weight" not in stored
