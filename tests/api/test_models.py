"""The ShardedModel API models and the CRD generated from them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardwise import cli
from shardwise.crds import models
from shardwise.crds.checkpointstore import STORE_OPTIONS_NEED_URI
from shardwise.crds.models import PlanSummary, ShardedModel, load_manifest, parse_quantity
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.crds.schema import CRD_FILE, crd, crd_yaml

ROOT = Path(__file__).resolve().parents[2]


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


def training(replicas: int = 1, pipeline: int | None = None, **fields) -> dict:
    return minimal(workload="training", checkpoint={"claim": "c"},
                   parallelism={"replicas": replicas, **({"pipeline": pipeline} if pipeline else {})},
                   training={"data": "/d.txt", "steps": 5, **fields})


def test_training_layout_fields_default_and_write_back_in_camel_case():
    t = load_manifest(training()).spec.training
    assert (t.data_parallel, t.schedule, t.activation_checkpointing, t.gradient_compression) == (
        None, models.PipelineSchedule.ONE_F_ONE_B, False, None)
    assert t.schedule == "1F1B"   # a str enum: the worker may compare it with the YAML's text
    sm = load_manifest(training(4, pipeline=2, dataParallel={"shard": 2, "replicate": 2}, schedule="Interleaved1F1B",
                                microBatches=4, activationCheckpointing=True,
                                gradientCompression={"method": "topk", "density": 0.05}))
    out = sm.to_api()["spec"]["training"]
    assert out["dataParallel"] == {"shard": 2, "replicate": 2} and out["schedule"] == "Interleaved1F1B"
    assert out["activationCheckpointing"] is True and out["gradientCompression"] == {"method": "topk", "density": 0.05,
                                                                                  "warmupSteps": 0, "rank": 8}
    assert ShardedModel.model_validate(sm.to_api()) == sm
    assert load_manifest(training(2, gradientCompression={})).spec.training.gradient_compression.model_dump() == {
        "method": "none", "density": 0.01, "warmup_steps": 0, "rank": 8}


@pytest.mark.parametrize("replicas, fields", [
    (4, {"dataParallel": {"shard": 4}}), (4, {"dataParallel": {"replicate": 2}}), (6, {"dataParallel": {"shard": 3, "replicate": 2}}),
    (0, {"dataParallel": {"shard": 2, "replicate": 2}}),      # scaled to 0: a paused job keeps its layout
    (2, {"schedule": "Interleaved1F1B", "microBatches": 5}),   # pipeline left to the planner: it judges
])
def test_training_layouts_that_are_accepted(replicas, fields):
    load_manifest(training(replicas, **fields))


@pytest.mark.parametrize("replicas, pipeline, fields, message", [
    (3, None, {"dataParallel": {"shard": 2, "replicate": 2}},
     "training.dataParallel: shard x replicate x contextParallel must equal parallelism.replicas (shard 2 x replicate 2 = 4, replicas 3)"),
    (4, None, {"dataParallel": {"shard": 3}},
     "training.dataParallel.shard x contextParallel must divide parallelism.replicas (shard 3, replicas 4)"),
    (6, None, {"dataParallel": {"replicate": 4}},
     "training.dataParallel.replicate x contextParallel must divide parallelism.replicas (replicate 4, replicas 6)"),
    (1, 4, {"schedule": "Interleaved1F1B", "microBatches": 6},
     "training.microBatches must be a multiple of parallelism.pipeline for schedule Interleaved1F1B (microBatches 6, pipeline 4)"),
    (2, None, {"dataParallel": {"shard": 0}}, "spec.training.dataParallel.shard: Input should be greater than or equal to 1"),
    (2, None, {"gradientCompression": {"density": 0}},
     "spec.training.gradientCompression.density: Input should be greater than 0"),
    (2, None, {"gradientCompression": {"method": "topk", "density": 1.01}},
     "spec.training.gradientCompression.density: Input should be less than or equal to 1"),
    (2, None, {"gradientCompression": {"method": "fp8"}},
     "spec.training.gradientCompression.method: Input should be 'none', 'int8', 'int4', 'topk', 'topk-int4' or 'powersgd'"),
    (2, None, {"gradientCompression": {"method": "powersgd", "rank": 0}},
     "spec.training.gradientCompression.rank: Input should be greater than or equal to 1"),
    (2, None, {"gradientCompression": {"method": "powersgd", "rank": 257}},
     "spec.training.gradientCompression.rank: Input should be less than or equal to 256"),
    (2, None, {"schedule": "ZeroBubble"}, "spec.training.schedule: Input should be '1F1B', 'GPipe' or 'Interleaved1F1B'"),
    (2, None, {"minReplicas": 3}, "training.minReplicas must not exceed parallelism.replicas (minReplicas 3, replicas 2)"),
    (2, None, {"minReplicas": 0}, "spec.training.minReplicas: Input should be greater than or equal to 1"),
])
def test_training_layout_refusals_name_the_field_in_one_line(replicas, pipeline, fields, message):
    with pytest.raises(ValueError) as e:
        load_manifest(training(replicas, pipeline, **fields))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_training_layout_rules_are_cel_rules_with_the_same_words():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["fieldPath"]: r for r in spec["x-kubernetes-validations"] if r.get("fieldPath", "").startswith(".training.")}
    assert rules[".training.dataParallel"]["message"] == models.DP_PRODUCT
    assert rules[".training.dataParallel.shard"]["message"] == (
        "training.dataParallel.shard x contextParallel must divide parallelism.replicas")
    assert rules[".training.microBatches"]["message"] == models.INTERLEAVED_MICRO_BATCHES
    training_schema = spec["properties"]["training"]["properties"]
    density = training_schema["gradientCompression"]["properties"]["density"]
    assert (density["minimum"], density["exclusiveMinimum"], density["maximum"]) == (0, True, 1)
    assert training_schema["schedule"]["enum"] == ["1F1B", "GPipe", "Interleaved1F1B"]
    assert training_schema["schedule"]["default"] == "1F1B"


def test_min_replicas_defaults_to_all_replicas_and_a_paused_job_keeps_it():
    assert load_manifest(training(4)).spec.min_replicas() == 4
    assert load_manifest(training(4, minReplicas=2)).spec.min_replicas() == 2
    assert load_manifest(training(0, minReplicas=2)).spec.min_replicas() == 0   # paused: scaled to 0
    assert load_manifest(training(4, minReplicas=2)).spec.training.termination_grace_period_seconds == 120


def test_local_checkpoint_tier_defaults_and_writes_back():
    sm = load_manifest(minimal(workload="training", checkpoint={"claim": "c", "local": {}},
                               training={"data": "/d.txt", "steps": 5}))
    local = sm.spec.checkpoint.local
    assert (local.path, local.host_path, local.interval_steps, local.keep) == (
        "/local-checkpoints", "/var/lib/shardwise/checkpoints", 10, 2)
    assert sm.to_api()["spec"]["checkpoint"]["local"]["hostPath"] == "/var/lib/shardwise/checkpoints"
    assert ShardedModel.model_validate(sm.to_api()) == sm


@pytest.mark.parametrize("checkpoint, message", [
    ({"local": {}}, models.LOCAL_NEEDS_CLAIM),
    ({"claim": "c", "local": {"path": "/checkpoints"}}, "checkpoint.local.path must differ from checkpoint.path (both /checkpoints)"),
    ({"claim": "c", "path": "/x", "local": {"path": "/x"}}, "checkpoint.local.path must differ from checkpoint.path (both /x)"),
    ({"claim": "c", "local": {"path": "relative"}}, "spec.checkpoint.local.path: String should match pattern"),
    ({"claim": "c", "local": {"hostPath": "var/lib"}}, "spec.checkpoint.local.hostPath: String should match pattern"),
    ({"claim": "c", "local": {"intervalSteps": 0}}, "spec.checkpoint.local.intervalSteps: Input should be greater than or equal to 1"),
])
def test_local_checkpoint_refusals_name_the_field_in_one_line(checkpoint, message):
    with pytest.raises(ValueError) as e:
        load_manifest(minimal(checkpoint=checkpoint))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_elastic_and_local_tier_rules_are_cel_rules_with_the_same_words():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["fieldPath"]: r for r in spec["x-kubernetes-validations"] if "fieldPath" in r}
    assert rules[".training.minReplicas"]["message"] == models.MIN_REPLICAS
    checkpoint = {r["fieldPath"]: r["message"] for r in spec["properties"]["checkpoint"]["x-kubernetes-validations"]}
    assert checkpoint == {".local": models.LOCAL_NEEDS_CLAIM, ".local.path": models.LOCAL_PATH_DIFFERS,
                          ".uri": STORE_OPTIONS_NEED_URI}
    local = spec["properties"]["checkpoint"]["properties"]["local"]["properties"]
    assert (local["path"]["default"], local["intervalSteps"]["default"], local["keep"]["default"]) == (
        "/local-checkpoints", 10, 2)


def test_checkpoint_uri_is_the_shared_tier_beside_or_instead_of_a_claim():
    training = {"data": "/d.txt", "steps": 5}
    sm = load_manifest(minimal(workload="training", training=training, checkpoint={
        "uri": "s3://ckpts/llama/run-1", "endpoint": "http://minio.storage:9000", "region": "eu-1",
        "pathStyle": True, "credentialsRef": {"name": "ckpt-keys"}, "local": {}}))
    c = sm.spec.checkpoint
    assert (c.uri, c.endpoint, c.region, c.path_style, c.credentials_ref.name, c.claim) == (
        "s3://ckpts/llama/run-1", "http://minio.storage:9000", "eu-1", True, "ckpt-keys", None)
    assert sm.to_api()["spec"]["checkpoint"]["credentialsRef"] == {"name": "ckpt-keys"}
    assert ShardedModel.model_validate(sm.to_api()) == sm
    assert load_manifest(minimal(workload="training", training=training,
                                 checkpoint={"claim": "c", "uri": "s3://ckpts/x"})).spec.checkpoint.claim == "c"


@pytest.mark.parametrize("checkpoint, message", [
    ({"claim": "c", "endpoint": "http://minio:9000"}, STORE_OPTIONS_NEED_URI),
    ({"claim": "c", "credentialsRef": {"name": "k"}}, STORE_OPTIONS_NEED_URI),
    ({"uri": "gs://b/x"}, "spec.checkpoint.uri: String should match pattern"),
    ({"uri": "s3://ckpts/x", "endpoint": "http://user:pw@minio:9000"}, "spec.checkpoint.endpoint: String should match pattern"),
])
def test_checkpoint_store_refusals_are_one_line(checkpoint, message):
    with pytest.raises(ValueError) as e:
        load_manifest(minimal(checkpoint=checkpoint))
    assert message in str(e.value) and "\n" not in str(e.value)


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


def test_a_model_name_is_refused_offline_when_a_derived_name_would_be_invalid():
    import re

    from shardwise.crds import names
    from shardwise.crds.models import NAME_NOT_DNS_LABEL, NAME_TOO_LONG, model_name_problem

    longest = "m" * names.MAX_MODEL_NAME
    assert model_name_problem(longest) == ""
    label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    last_replica, last_stage = names.MAX_REPLICAS - 1, names.MAX_PIPELINE - 1
    for derived in (names.hostname(longest, last_replica, last_stage), names.headless_service_name(longest),
                    names.serving_service_name(longest)):
        assert len(derived) <= names.DNS_LABEL_MAX and label.match(derived), derived
    assert len(names.pod_name(longest, last_replica, last_stage, names.MAX_ATTEMPTS)) <= names.DNS_SUBDOMAIN_MAX
    assert model_name_problem(longest + "m") == NAME_TOO_LONG
    assert model_name_problem("8b-chat") == NAME_NOT_DNS_LABEL
    assert model_name_problem("llama.3") == NAME_NOT_DNS_LABEL
