"""The ShardedModel API models and the CRD generated from them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardwise import cli
from shardwise.crds import models
from shardwise.crds.models import PlanSummary, ShardedModel, load_manifest, parse_quantity
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.crds.schema import CRD_FILE, crd, crd_yaml

ROOT = Path(__file__).resolve().parents[1]


def minimal(**spec) -> dict:
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "/models/llama"}, **spec}}


def test_camel_case_manifest_reads_and_writes_back_with_defaults():
    sm = load_manifest(minimal(parallelism={"tensor": 4, "pipeline": 2}, recovery={"maxRestarts": 7, "allowShrink": True},
                               gpu={"minMemory": "40Gi"}, checkpoint={"claim": "ckpt", "intervalSteps": 50}))
    assert sm.spec.parallelism.tensor == 4 and sm.spec.recovery.max_restarts == 7
    assert sm.spec.gpu.min_memory_bytes() == 40 * 2**30
    out = sm.to_api()["spec"]
    assert out["recovery"] == {"maxRestarts": 7, "backoffSeconds": 10, "allowShrink": True}
    assert out["parallelism"] == {"tensor": 4, "pipeline": 2, "replicas": 1}
    assert out["checkpoint"]["intervalSteps"] == 50 and out["gpu"]["resourceName"] == "nvidia.com/gpu"
    assert ShardedModel.model_validate(sm.to_api()) == sm


def test_omitted_parallelism_means_the_planner_chooses():
    sm = load_manifest(minimal())
    assert sm.spec.parallelism.tensor is None and sm.spec.parallelism.pipeline is None
    assert sm.spec.parallelism.replicas == 1
    assert sm.spec.placement.topology_keys == ["topology.shardwise.dev/rack", "topology.kubernetes.io/zone"]


@pytest.mark.parametrize("spec, message", [
    ({"parallelism": {"tensr": 2}}, "spec.parallelism.tensr: Extra inputs are not permitted"),
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor: Input should be greater than or equal to 1"),
    ({"workload": "serve"}, "spec.workload: Input should be 'inference' or 'training'"),
    ({"model": {"uri": "/m/x.bin", "format": "gguf"}}, "model.uri must name a .gguf file when model.format is gguf"),
    ({"model": {"uri": "/m", "heads": 32, "kvHeads": 8}, "parallelism": {"tensor": 3}},
     "parallelism.tensor must divide model.heads"),
    ({"model": {"uri": "/m", "layers": 4}, "parallelism": {"pipeline": 5}}, "parallelism.pipeline must not exceed model.layers"),
    ({"resources": {"limits": {"nvidia.com/gpu": 8}}}, "must not name the GPU resource"),
    ({"placement": {"topologyKeys": ["a", "a"]}}, "topology keys must not repeat"),
    ({"workload": "training", "checkpoint": {"claim": "c"}}, "workload training needs spec.training"),
    ({"workload": "training", "training": {"data": "/d.txt", "steps": 5}}, "workload training needs checkpoint.claim"),
    ({"training": {"data": "/d.txt", "steps": 5}}, "spec.training is only for workload: training"),
    ({"workload": "training", "checkpoint": {"claim": "c"}, "training": {"data": "pvc://Bad/x", "steps": 5}},
     "training.data must look like pvc://<claim>/<path>"),
    ({"workload": "training", "checkpoint": {"claim": "c"}, "training": {"data": "/d.txt", "steps": 0}},
     "spec.training.steps: Input should be greater than or equal to 1"),
])
def test_bad_spec_is_refused_in_one_line_naming_the_field(spec, message):
    with pytest.raises(ValueError) as e:
        load_manifest(minimal(**spec))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_training_spec_reads_with_defaults_and_writes_back():
    sm = load_manifest(minimal(workload="training", checkpoint={"claim": "ckpt"},
                               training={"data": "pvc://corpora/wiki.txt", "steps": 500, "learningRate": 1e-4}))
    t = sm.spec.training
    assert (t.steps, t.batch_size, t.seq_length, t.learning_rate, t.seed) == (500, 8, 64, 1e-4, 0)
    assert sm.to_api()["spec"]["training"]["learningRate"] == 1e-4
    assert ShardedModel.model_validate(sm.to_api()) == sm


def test_model_helpers():
    sm = load_manifest(minimal(model={"uri": "pvc://weights/llama/3"}))
    assert sm.spec.model.pvc() == ("weights", "llama/3")
    assert sm.spec.model.resolved_format() == "safetensors"
    assert load_manifest(minimal(model={"uri": "/m/a.gguf"})).spec.model.resolved_format() == "gguf"
    assert parse_quantity("81559Mi") == 81559 * 2**20 and parse_quantity("80G") == 80 * 10**9
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity("lots")


# ------------------------------------------------------------------ the generated CRD


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from _walk(node[key], f"{path}[{key}]")


def test_schema_is_structural_and_refuses_unknown_fields():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for bad in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs"):
            assert bad not in node, f"{path} has {bad}"
        if path.startswith("$.spec") or path.startswith("$.status"):
            assert "x-kubernetes-preserve-unknown-fields" not in node, f"{path} keeps unknown fields"
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["model"] and spec["properties"]["model"]["required"] == ["uri"]
    assert len(spec["x-kubernetes-validations"]) >= 5


def test_scale_subresource_paths_and_printer_columns_point_at_real_fields():
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]

    def field(json_path: str) -> dict:
        node = schema
        for part in json_path.strip(".").split("."):
            node = node["properties"][part]
        return node

    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.parallelism.replicas"
    assert field(scale["specReplicasPath"])["type"] == "integer"
    assert field(scale["statusReplicasPath"])["type"] == "integer"
    assert field(scale["labelSelectorPath"])["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Tensor", "Pipeline", "Replicas", "Ready", "Phase", "Step", "Checkpoint", "Age"]
    for name, path in columns.items():
        if not path.startswith(".metadata"):
            field(path)
    # the training columns only with -o wide
    assert {c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")} == {"Step", "Checkpoint"}
    assert crd()["spec"]["names"]["shortNames"] == ["sm"]


def test_checked_in_crd_matches_the_models(capsys):
    assert cli.main(["crds", "check"]) == 0
    assert CRD_FILE.read_text() == crd_yaml()


def test_crds_check_fails_on_drift_and_generate_repairs_it(tmp_path, capsys):
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd_yaml().replace("maxRestarts", "maxRetries"))
    assert cli.main(["crds", "check", str(stale)]) == 1
    assert "differs from crds/models.py" in capsys.readouterr().err
    assert cli.main(["crds", "generate", "-o", str(stale)]) == 0
    assert cli.main(["crds", "check", str(stale)]) == 0


def test_every_spec_field_is_documented():
    doc = (ROOT / "docs" / "api.md").read_text()
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [path.removeprefix("$.") for path, node in _walk(spec, "$.spec")
               if "[" not in path and path != "$.spec" and f"`{path.removeprefix('$.')}`" not in doc]
    assert not missing, f"docs/api.md does not describe {missing}"


def test_examples_are_valid_shardedmodels():
    found = 0
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "ShardedModel":
                load_manifest(doc)
                found += 1
    assert found >= 3


def test_plan_summary_for_status():
    plan = ShardPlan(tensor=2, pipeline=2, replicas=1, num_layers=10, cost=1, placements=[
        StagePlacement(replica=0, stage=0, node="a", gpus=2, layer_start=0, layer_end=6, embedding=True, head=False),
        StagePlacement(replica=0, stage=1, node="b", gpus=2, layer_start=6, layer_end=10, embedding=False, head=True)])
    summary = PlanSummary.from_plan(plan).to_api()
    assert summary["placements"][1] == {"replica": 0, "stage": 1, "node": "b", "gpus": 2, "layers": "6-9"}
    status = models.ShardedModelStatus(phase="Running", plan=PlanSummary.from_plan(plan), ready_replicas=1).to_api()
    assert status["readyReplicas"] == 1 and status["plan"]["cost"] == 1
    assert re.fullmatch(r"[A-Za-z]+", status["phase"])
