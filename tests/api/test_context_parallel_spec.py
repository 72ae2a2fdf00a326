"""spec.training.contextParallel: the C ranks of a sequence are replicas, refused with one line (pydantic)
and by the CRD's CEL rules with the same words."""
from __future__ import annotations

import re

import pytest

from shardwise.crds import models
from shardwise.crds.models import ShardedModel, load_manifest
from shardwise.crds.schema import crd


def training(replicas: int, **fields) -> dict:
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "/models/llama"}, "workload": "training", "checkpoint": {"claim": "c"},
                     "parallelism": {"replicas": replicas},
                     "training": {"data": "/d.txt", "steps": 5, "seqLength": 64, **fields}}}


ACCEPTED = [
    (4, {"contextParallel": 2}),                                          # 2 sequences' worth of replicas
    (8, {"contextParallel": 2, "dataParallel": {"shard": 2, "replicate": 2}}),
    (8, {"contextParallel": 4, "dataParallel": {"shard": 2}}),
    (6, {"contextParallel": 3, "seqLength": 6}),
    (0, {"contextParallel": 2, "dataParallel": {"shard": 2, "replicate": 2}}),   # paused: the layout stays
    (3, {"contextParallel": 1, "seqLength": 3}),                          # 1: no split, any length
    (4, {"dataParallel": {"shard": 2, "replicate": 2}}),                  # without it, as before
]
REFUSED = [
    (3, {"contextParallel": 2}, "training.contextParallel must divide parallelism.replicas: the ranks of a "
                                "sequence are replicas (tensor x pipeline groups) (contextParallel 2, replicas 3)"),
    (4, {"contextParallel": 2, "seqLength": 66},
     "training.seqLength must be a multiple of 2 x training.contextParallel: each sequence is cut into 2 chunks "
     "per context-parallel rank (seqLength 66, contextParallel 2)"),
    (4, {"contextParallel": 2, "dataParallel": {"shard": 2, "replicate": 2}},
     "training.dataParallel: shard x replicate x contextParallel must equal parallelism.replicas "
     "(shard 2 x replicate 2 x contextParallel 2 = 8, replicas 4)"),
    (4, {"contextParallel": 2, "dataParallel": {"shard": 4}},
     "training.dataParallel.shard x contextParallel must divide parallelism.replicas (shard 4 x contextParallel 2, "
     "replicas 4)"),
    (4, {"contextParallel": 0}, "spec.training.contextParallel: Input should be greater than or equal to 1"),
    (128, {"contextParallel": 128}, "spec.training.contextParallel: Input should be less than or equal to 64"),
]


@pytest.mark.parametrize("replicas, fields", ACCEPTED)
def test_context_parallel_layouts_that_are_accepted(replicas, fields):
    t = load_manifest(training(replicas, **fields)).spec.training
    assert t.context_parallel == fields.get("contextParallel", 1)


@pytest.mark.parametrize("replicas, fields, message", REFUSED)
def test_context_parallel_refusals_name_the_field_in_one_line(replicas, fields, message):
    with pytest.raises(ValueError) as e:
        load_manifest(training(replicas, **fields))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_context_parallel_writes_back_and_is_left_out_at_one():
    sm = load_manifest(training(4, contextParallel=2))
    assert sm.to_api()["spec"]["training"]["contextParallel"] == 2
    assert ShardedModel.model_validate(sm.to_api()) == sm
    # at 1 the spec's JSON is what it was before the field existed: the same hash, the same pods
    assert "contextParallel" not in load_manifest(training(4)).to_api()["spec"]["training"]
    assert "context_parallel" not in load_manifest(training(4)).spec.model_dump()["training"]


# --- the CEL rules, evaluated here for the forms they take (has(), ?:, %, *), so the API server and
# `shardwise plan -f` refuse the same specs with the same words.

def _python(rule: str) -> str:
    rule = re.sub(r"!has\(self\.([\w.]+)\)", r"(not _has(s, '\1'))", rule)
    rule = re.sub(r"has\(self\.([\w.]+)\)", r"_has(s, '\1')", rule)
    rule = re.sub(r"self\.([\w.]+)", r"_get(s, '\1')", rule)
    rule = re.sub(r"\((_has\(s, '[\w.]+'\)) \? (_get\(s, '[\w.]+'\)) : (\d+)\)", r"(\2 if \1 else \3)", rule)
    rule = rule.replace("||", " or ").replace("&&", " and ").replace("!=", "<>")
    return rule.replace("!", " not ").replace("<>", "!=")


def _has(s: dict, path: str) -> bool:
    for key in path.split("."):
        if not isinstance(s, dict) or key not in s:
            return False
        s = s[key]
    return True


def _get(s: dict, path: str):
    for key in path.split("."):
        s = s[key]
    return s


def _cel_refusal(spec: dict) -> str:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    checks = [(r, spec) for r in schema["x-kubernetes-validations"] if r.get("fieldPath", "").startswith(".training")]
    checks += [(r, spec["training"]) for r in schema["properties"]["training"]["x-kubernetes-validations"]
               if "seqLength" in r["rule"]]
    for r, obj in checks:
        if not eval(_python(r["rule"]), {"_has": _has, "_get": _get, "s": obj}):
            return r["message"]
    return ""


@pytest.mark.parametrize("replicas, fields", ACCEPTED)
def test_cel_rules_accept_what_python_accepts(replicas, fields):
    assert _cel_refusal(training(replicas, **fields)["spec"]) == ""


@pytest.mark.parametrize("replicas, fields, message", [r for r in REFUSED if "Input should" not in r[2]])
def test_cel_rules_refuse_with_the_same_words(replicas, fields, message):
    refusal = _cel_refusal(training(replicas, **fields)["spec"])
    assert refusal and message.startswith(refusal)


def test_the_rules_are_the_crds():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = {r["message"] for r in schema["x-kubernetes-validations"]}
    assert {models.CP_DIVIDES, models.DP_PRODUCT} <= messages
    field = schema["properties"]["training"]["properties"]["contextParallel"]
    assert (field["minimum"], field["maximum"], field["default"]) == (1, 64, 1)
