"""The model's ConfigMap at the most replicas the API allows: the pod contract inside lists every
placement of the plan, and the API server refuses a ConfigMap over 1 MiB, which would leave the
model without pods and never Ready. Measured as the compact JSON the API server stores."""
from __future__ import annotations

import base64
import gzip
import json

import pytest

from shardwise.crds import names
from shardwise.crds.models import ShardedModel, ShardedModelSpec
from shardwise.crds.plan import ShardPlan
from shardwise.operator.render import renderer
from tests.operator.test_status_size import _plan

CONFIGMAP_LIMIT = 1 << 20     # the API server's bound on a ConfigMap's data


def _model(replicas: int, pipeline: int) -> ShardedModel:
    spec = {"model": {"uri": "pvc://weights/llama-8b"},
            "parallelism": {"tensor": 2, "pipeline": pipeline, "replicas": replicas}}
    return ShardedModel(metadata={"name": "llama-8b-chat", "namespace": "team-a", "uid": "u-1"},
                        spec=ShardedModelSpec.model_validate(spec))


def test_the_contract_of_the_most_replicas_fits_in_one_configmap_and_reads_back_whole():
    plan = _plan(names.MAX_REPLICAS, 4)
    configmap = renderer.render_configmap(_model(names.MAX_REPLICAS, 4), plan)
    size = len(json.dumps(configmap, separators=(",", ":")).encode())
    assert size < CONFIGMAP_LIMIT, size     # about 285 KB (it was 11.7 MB, indented JSON in data)
    assert renderer.plan_from_configmap(configmap) == plan


@pytest.mark.controlplane
def test_the_api_server_takes_the_configmap_of_the_most_replicas_and_gives_the_plan_back(kubectl, namespace):
    """Server-side apply, as the operator applies it; the read-back is the operator's own."""
    plan = _plan(names.MAX_REPLICAS, 4)
    configmap = renderer.render_configmap(_model(names.MAX_REPLICAS, 4), plan)
    del configmap["metadata"]["ownerReferences"]      # no such model here: the collector would delete it
    configmap["metadata"]["namespace"] = namespace
    kubectl("apply", "--server-side", "--field-manager=shardwise", "-f", "-", input=json.dumps(configmap))
    stored = json.loads(kubectl("get", "configmap", configmap["metadata"]["name"], "-o", "json"))
    assert renderer.plan_from_configmap(stored) == plan
    # what docs/operator.md tells people to run: the jsonpath, then `base64 -d | gunzip`
    encoded = kubectl("get", "configmap", configmap["metadata"]["name"], "-o",
                      r"jsonpath={.binaryData.contract\.json\.gz}")
    assert ShardPlan.model_validate(json.loads(gzip.decompress(base64.b64decode(encoded)))["plan"]) == plan
