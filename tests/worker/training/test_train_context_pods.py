"""Context parallelism in a training ShardedModel's pods: the pod contract (plan.context,
spec.training.contextParallel) gives the trainer the layout `shardwise train --context-parallel C` gives,
and two pods holding one sequence between them train exactly as the command does."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from shardwise.crds.contract import PodContract
from shardwise.crds.modelshape import from_hf_config
from shardwise.crds.models import ShardedModel, ShardedModelSpec
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.operator.planning.planner import plan as make_plan
from shardwise.operator.render.renderer import configmap_contract, render_configmap
from shardwise.worker.cli import train as train_cli
from shardwise.worker.training.trainer import options_from_contract, pod_rank
from tests.operator.builders import gpu_node
from tests.worker.training.test_train import _free_port, _training_contract

STEPS = 3
COMMON = ["--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32", "--lr", "3e-3", "--seed", "7", "--json"]
TINY = from_hf_config(dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                           intermediate_size=128, vocab_size=256), "float32")


def _cli_options(*flags: str):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.options(parser.parse_args(["--model", "m", "--data", "d", "--steps", "1",
                                                "--checkpoint-dir", "c", *flags]))


@pytest.mark.parametrize("replicas, tensor, pipeline, training, flags", [
    (4, 1, 1, {"contextParallel": 2}, ["--context-parallel", "2", "--data-parallel", "2", "--data-shard", "1"]),
    (8, 2, 2, {"contextParallel": 2, "dataParallel": {"shard": 2}},
     ["--context-parallel", "2", "--data-parallel", "4", "--data-shard", "2", "-t", "2", "-p", "2"]),
    (8, 1, 1, {"contextParallel": 4, "dataParallel": {"replicate": 2}},
     ["--context-parallel", "4", "--data-parallel", "2", "--data-shard", "1"]),
])
def test_the_contract_gives_the_layout_of_the_cli_flags(replicas, tensor, pipeline, training, flags):
    """The operator's plan and contract, read by the pod, against the flags a user gives `shardwise
    train`: the same mesh (replicate, shard, pipeline, tensor, context) and so the same ranks."""
    spec = ShardedModelSpec.model_validate({
        "model": {"uri": "/m"}, "workload": "training", "checkpoint": {"claim": "c"},
        "parallelism": {"replicas": replicas, "tensor": tensor, "pipeline": pipeline},
        "training": {"data": "/d.txt", "steps": 9, "seqLength": 64, **training}})
    plan = make_plan(spec, TINY, [gpu_node(f"n{i}", 8) for i in range(4)])
    cm = render_configmap(ShardedModel(metadata={"name": "t", "namespace": "n", "uid": "u"}, spec=spec), plan)
    opts = options_from_contract(PodContract.from_json(configmap_contract(cm)), device="cpu", dtype="float32")
    cli = _cli_options(*[{"-t": "--tensor-parallel", "-p": "--pipeline-parallel"}.get(f, f) for f in flags])
    assert opts.mesh_shape == cli.mesh_shape and opts.world_size == cli.world_size
    # every GPU of every pod is one rank of that world, each once
    ranks = [pod_rank(p.replica, p.stage, g, plan) for p in plan.placements for g in range(p.gpus)]
    assert sorted(ranks) == list(range(opts.world_size)) and len(plan.placements) == replicas * pipeline


@pytest.mark.slow   # two pods and the command: real processes, about 40 s on a busy 2-core machine
def test_two_pods_holding_one_sequence_train_as_the_command_does(work, train, tmp_path):
    """A contextParallel 2 job of 2 replicas: two `shardwise worker` pods, one world, each rank half
    of every sequence; the losses are those of `shardwise train --context-parallel 2`."""
    code, want, err = train.run(tmp_path / "cli", *COMMON, "--context-parallel", "2", env={"OMP_NUM_THREADS": "1"})
    assert code == 0, err
    plan = ShardPlan(tensor=1, pipeline=1, replicas=2, num_layers=4, data_shard=2, context=2, placements=[
        StagePlacement(replica=r, stage=0, node=f"node-{r}", gpus=1, layer_start=0, layer_end=4, embedding=True,
                       head=True) for r in range(2)])
    env = {**os.environ, "POD_IP": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    pods = []
    for r in range(2):
        contract = _training_contract(
            tmp_path / f"contract-{r}.json", plan, work / "model", _free_port(), tmp_path / f"termination-{r}",
            work / "data.txt", tmp_path / "ck", STEPS, learning_rate=3e-3, seed=7, batch_size=2, seq_length=32,
            context_parallel=2)
        pods.append(subprocess.Popen(
            [sys.executable, "-m", "shardwise", "worker", "--contract", contract, "--device", "cpu"],
            env={**env, "SHARDWISE_REPLICA": str(r), "SHARDWISE_STAGE": "0"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in pods) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in pods:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate(timeout=30) for p in pods]
    assert [p.returncode for p in pods] == [0, 0], "\n".join(o[1][-2000:] for o in outs)
    assert "ranks 0..0 of 2" in outs[0][1] and "ranks 1..1 of 2" in outs[1][1]
    assert "TP=1 PP=1 DP=1 CP=2" in outs[0][1], outs[0][1][-2000:]   # context parallel, not data parallel
    got = train.records(outs[0][0])
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-6), f"step {s}"
