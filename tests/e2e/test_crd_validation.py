"""The API server refuses bad ShardedModels, naming the field, before any operator sees them.

Runs against the real local control plane (kube-apiserver + etcd) from the session `cluster`
fixture (shardwise.e2e.pytest_plugin, loaded by tests/conftest.py); skipped when the Kubernetes
binaries are not built.
"""
from __future__ import annotations

import copy
import secrets
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from shardwise.crds.autoscaling import KV_OVER_ONE, MIN_OVER_MAX
from shardwise.crds.router import ROUTER_SERVING_ONLY
from shardwise.crds.rollout import NO_STEP
from shardwise.crds.capacity import CONTEXT_OVER_CACHE
from shardwise.crds.models import (AUTOSCALING_SERVING_ONLY, CP_DIVIDES, CP_SEQUENCE, DP_DIVIDES, DP_PRODUCT,
                                   INTERLEAVED_MICRO_BATCHES, LOCAL_NEEDS_CLAIM, LOCAL_PATH_DIFFERS, MIN_REPLICAS, NAME_NOT_DNS_LABEL, NAME_TOO_LONG,
                                   load_manifest)
from shardwise.crds.names import MAX_MODEL_NAME
from shardwise.crds.schema import CRD_FILE
from shardwise.crds.sourcespec import REMOTE_ONLY

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kubectl(cluster) -> Callable[..., str]:
    """kubectl in a namespace of this module's own, the ShardedModel CRD installed and Established."""
    namespace = f"crd-validation-{secrets.token_hex(3)}"
    cluster.client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    cluster.install_crd(CRD_FILE)

    def run(*args: str, input: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, input=input, check=check, namespace=namespace)

    yield run
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def refusal(kubectl, *args: str, input: str | None = None) -> str:
    """The API server's refusal of a kubectl command that must fail."""
    with pytest.raises(AssertionError) as failed:
        kubectl(*args, input=input)
    return str(failed.value)


GOOD: dict[str, Any] = {
    "apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},
    "spec": {"model": {"uri": "pvc://models/llama-3-8b", "heads": 32, "kvHeads": 8, "layers": 32}},
}


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(GOOD)
    out["metadata"]["name"] = name
    for path, value in spec.items():  # "parallelism__tensor" -> spec.parallelism.tensor
        *parents, leaf = path.split("__")
        node = out["spec"]
        for p in parents:
            node = node.setdefault(p, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


_DELETE = object()


def training_manifest(replicas: int, pipeline: int | None = None, **training: Any) -> dict[str, Any]:
    """A training ShardedModel over `replicas` data-parallel replicas with these training fields."""
    parallelism = {"replicas": replicas, **({"pipeline": pipeline} if pipeline else {})}
    return manifest("a", workload="training", checkpoint={"claim": "ckpt"}, parallelism=parallelism,
                    training={"data": "/d.txt", "steps": 5, **training})

# (manifest, field the refusal names, words of the refusal)
BAD = {
    "tensor-zero": (manifest("a", parallelism__tensor=0), "spec.parallelism.tensor", "greater than or equal to 1"),
    "replicas-negative": (manifest("a", parallelism__replicas=-1), "spec.parallelism.replicas", "greater than or equal to 0"),
    "workload-enum": (manifest("a", workload="serve"), "spec.workload", 'supported values: "inference", "training"'),
    "model-missing": (manifest("a", model=_DELETE), "spec.model", "Required value"),
    "uri-missing": (manifest("a", model__uri=_DELETE), "spec.model.uri", "Required value"),
    "unknown-field": (manifest("a", tensorParallel=2), "spec.tensorParallel", "unknown field"),
    "unknown-nested": (manifest("a", recovery__retries=2), "spec.recovery.retries", "unknown field"),
    "gguf-uri": (manifest("a", model__format="gguf"), "spec.model.uri", "must name a .gguf file"),
    "pvc-uri": (manifest("a", model__uri="pvc://Models_Bad"), "spec.model.uri", "pvc://<claim>/<path>"),
    "tensor-heads": (manifest("a", parallelism__tensor=3), "spec.parallelism.tensor", "must divide model.heads"),
    "tensor-kv-heads": (manifest("a", model__heads=48, parallelism__tensor=16),
                        "spec.parallelism.tensor", "must divide model.kvHeads"),
    "pipeline-layers": (manifest("a", parallelism__pipeline=33), "spec.parallelism.pipeline", "must not exceed model.layers"),
    "gpu-in-resources": (manifest("a", resources={"limits": {"nvidia.com/gpu": "8"}}),
                         "spec.resources.limits", "must not name the GPU resource"),
    "toleration-exists-value": (manifest("a", placement__tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
                                "spec.placement.tolerations[0].value", "operator Exists must not set value"),
    "min-memory": (manifest("a", gpu__minMemory="lots"), "spec.gpu.minMemory", "should match"),
    "port": (manifest("a", serving__port=70000), "spec.serving.port", "less than or equal to 65535"),
    "topology-duplicate": (manifest("a", placement__topologyKeys=["rack", "rack"]),
                           "spec.placement.topologyKeys[1]", "Duplicate value"),
    "checkpoint-path": (manifest("a", checkpoint={"path": "relative/dir"}), "spec.checkpoint.path", "should match"),
    "training-without-spec": (manifest("a", workload="training", checkpoint={"claim": "ckpt"}),
                              "spec.training", "workload training needs spec.training"),
    "training-without-claim": (manifest("a", workload="training", training={"data": "/d.txt", "steps": 10}),
                               "spec.checkpoint", "workload training needs checkpoint.claim"),
    "training-for-inference": (manifest("a", training={"data": "/d.txt", "steps": 10}),
                               "spec.training", "only for workload: training"),
    "training-steps": (manifest("a", workload="training", checkpoint={"claim": "ckpt"},
                                training={"data": "/d.txt", "steps": 0}),
                       "spec.training.steps", "greater than or equal to 1"),
    "training-data-pvc": (manifest("a", workload="training", checkpoint={"claim": "ckpt"},
                                   training={"data": "pvc://data", "steps": 5}),
                          "spec.training.data", "pvc://<claim>/<path>"),
    # ZeRO-3 x HSDP, pipeline schedule, gradient compression; `shardwise plan -f` says the same
    # words and adds the values (test_training_layout_refusals_say_the_same_offline)
    "shard-x-replicate": (training_manifest(3, dataParallel={"shard": 2, "replicate": 2}),
                          "spec.training.dataParallel", DP_PRODUCT),
    "shard-divides": (training_manifest(4, dataParallel={"shard": 3}), "spec.training.dataParallel.shard",
                      DP_DIVIDES.format(axis="shard")),
    "replicate-divides": (training_manifest(6, dataParallel={"replicate": 4}), "spec.training.dataParallel.replicate",
                          DP_DIVIDES.format(axis="replicate")),
    "shard-zero": (training_manifest(2, dataParallel={"shard": 0}), "spec.training.dataParallel.shard",
                   "greater than or equal to 1"),
    "density-zero": (training_manifest(2, gradientCompression={"method": "topk", "density": 0}),
                     "spec.training.gradientCompression.density", "should be greater than 0"),
    "density-above-one": (training_manifest(2, gradientCompression={"method": "topk", "density": 1.5}),
                          "spec.training.gradientCompression.density", "less than or equal to 1"),
    "compression-method": (training_manifest(2, gradientCompression={"method": "fp4"}),
                           "spec.training.gradientCompression.method", 'supported values: "none", "int8", "int4", "topk", "topk-int4"'),
    "schedule-enum": (training_manifest(2, schedule="ZeroBubble"), "spec.training.schedule",
                      'supported values: "1F1B", "GPipe", "Interleaved1F1B"'),
    "interleaved-micro-batches": (training_manifest(1, pipeline=4, schedule="Interleaved1F1B", microBatches=6),
                                  "spec.training.microBatches", INTERLEAVED_MICRO_BATCHES),
    # context parallelism: the ranks of a sequence are replicas, each holding 2 of its 2C chunks
    "context-divides": (training_manifest(3, contextParallel=2), "spec.training.contextParallel", CP_DIVIDES),
    "context-chunks": (training_manifest(4, contextParallel=2, seqLength=66), "spec.training.seqLength", CP_SEQUENCE),
    # elastic training and the local checkpoint tier
    "min-replicas-above-replicas": (training_manifest(2, minReplicas=3), "spec.training.minReplicas", MIN_REPLICAS),
    "min-replicas-zero": (training_manifest(2, minReplicas=0), "spec.training.minReplicas",
                          "greater than or equal to 1"),
    "local-tier-without-claim": (manifest("a", checkpoint={"local": {}}), "spec.checkpoint.local", LOCAL_NEEDS_CLAIM),
    "local-tier-same-path": (manifest("a", checkpoint={"claim": "ckpt", "local": {"path": "/checkpoints"}}),
                             "spec.checkpoint.local.path", LOCAL_PATH_DIFFERS),
    # the model's name: every object it makes is named from it (crds/names.py MAX_MODEL_NAME)
    "name-too-long": (manifest("a" * (MAX_MODEL_NAME + 1)), "metadata.name", NAME_TOO_LONG),
    "name-with-dots": (manifest("llama.3"), "metadata.name", NAME_NOT_DNS_LABEL),
    "name-starting-with-a-digit": (manifest("8b-chat"), "metadata.name", NAME_NOT_DNS_LABEL),
    "local-tier-relative-host-path": (manifest("a", checkpoint={"claim": "ckpt", "local": {"hostPath": "var/x"}}),
                                      "spec.checkpoint.local.hostPath", "should match"),
    # a serving replica's capacity (crds/capacity.py)
    "context-over-cache": (manifest("a", serving={"maxModelLength": 9000}), "spec.serving.maxModelLength",
                           CONTEXT_OVER_CACHE),
    "concurrency-zero": (manifest("a", serving={"maxConcurrentRequests": 0}), "spec.serving.maxConcurrentRequests",
                         "greater than or equal to 1"),
    "waiting-unbounded": (manifest("a", serving={"maxWaiting": 10 ** 6}), "spec.serving.maxWaiting",
                          "less than or equal to 16384"),
    "decode-enum": (manifest("a", serving={"decode": "fast"}), "spec.serving.decode",
                    'supported values: "auto", "eager", "graphs", "compile"'),
    # speculative decoding (crds/speculative.py); its rule must also hold for the field's default {}
    "ngram-range-reversed": (manifest("a", serving={"speculative": {"method": "ngram", "ngramMin": 3, "ngramMax": 2}}),
                             "spec.serving.speculative", "ngramMin must not exceed ngramMax"),
    "ngram-min-over-default-max": (manifest("a", serving={"speculative": {"ngramMin": 5}}),
                                   "spec.serving.speculative", "ngramMin must not exceed ngramMax"),
    # autoscaling (crds/autoscaling.py)
    "autoscaling-min-over-max": (manifest("a", autoscaling={"minReplicas": 4, "maxReplicas": 2}),
                                 "spec.autoscaling.minReplicas", MIN_OVER_MAX),
    "autoscaling-without-max": (manifest("a", autoscaling={"minReplicas": 0}), "spec.autoscaling.maxReplicas",
                                "Required value"),
    "autoscaling-kv-over-one": (manifest("a", autoscaling={"maxReplicas": 3, "target": "kvCacheUtilization",
                                                           "targetValue": 80}),
                                "spec.autoscaling.targetValue", KV_OVER_ONE),
    "autoscaling-target-enum": (manifest("a", autoscaling={"maxReplicas": 3, "target": "cpu"}),
                                "spec.autoscaling.target", 'supported values: "queueDepthPerReplica"'),
    "autoscaling-target-zero": (manifest("a", autoscaling={"maxReplicas": 3, "targetValue": 0}),
                                "spec.autoscaling.targetValue", "greater than 0"),
    "autoscaling-for-training": (training_manifest(2) | {"spec": training_manifest(2)["spec"] |
                                                         {"autoscaling": {"maxReplicas": 3}}},
                                 "spec.autoscaling", AUTOSCALING_SERVING_ONLY),
    # the model's router (crds/router.py)
    "router-for-training": (training_manifest(2) | {"spec": training_manifest(2)["spec"] |
                                                    {"serving": {"router": {"enabled": True}}}},
                            "spec.serving.router", ROUTER_SERVING_ONLY),
    "router-replicas-over": (manifest("a", serving={"router": {"enabled": True, "replicas": 17}}),
                             "spec.serving.router.replicas", "less than or equal to 16"),
    "router-rate-limit-shape": (manifest("a", serving={"router": {"enabled": True, "rateLimit": "fast"}}),
                                "spec.serving.router.rateLimit", "should match"),
    # a remote model's fetch (crds/sourcespec.py)
    "fetch-streams-over": (manifest("a", model__uri="s3://models/llama", model__fetchStreams=33),
                           "spec.model.fetchStreams", "less than or equal to 32"),
    "fetch-streams-for-a-claim": (manifest("a", model__fetchStreams=4), "spec.model.fetchStreams", REMOTE_ONLY),
    # the roll's budgets (crds/rollout.py): maxSurge 0 with maxUnavailable's default 0 allows no step
    "rollout-no-step": (manifest("a", rollout={"maxSurge": 0}), "spec.rollout.maxSurge", NO_STEP),
    "rollout-surge-over": (manifest("a", rollout={"maxSurge": 17}), "spec.rollout.maxSurge",
                           "less than or equal to 16"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifest_is_refused_naming_the_field(kubectl, case):
    body, field, words = BAD[case]
    message = refusal(kubectl, "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body))
    assert field in message and words in message, message
    # `shardwise plan -f` refuses the same manifest offline, in one line
    with pytest.raises(ValueError) as offline:
        load_manifest(body)
    assert "\n" not in str(offline.value)


def test_examples_and_a_minimal_manifest_are_accepted_with_defaults(kubectl):
    examples = sorted(ROOT.glob("examples/*.yaml"))
    models = [d for f in examples for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") == "ShardedModel"]
    assert models, "no example ShardedModels"
    for body in models:
        kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body))  # raises when refused
    created = kubectl("create", "-o", "yaml", "-f", "-", input=yaml.safe_dump(manifest("minimal")))
    spec = yaml.safe_load(created)["spec"]
    assert spec["parallelism"]["replicas"] == 1 and spec["workload"] == "inference"
    assert spec["gpu"]["resourceName"] == "nvidia.com/gpu"
    assert spec["placement"]["topologyKeys"] == ["topology.shardwise.dev/rack", "topology.kubernetes.io/zone"]


def test_the_longest_allowed_name_is_accepted(kubectl):
    kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(manifest("m" * MAX_MODEL_NAME)))


def test_workload_cannot_change_after_creation(kubectl):
    kubectl("create", "-f", "-", input=yaml.safe_dump(manifest("fixed")))
    changed = manifest("fixed", workload="training")
    message = refusal(kubectl, "apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(changed))
    assert "spec.workload" in message and "workload cannot change" in message


def test_scale_subresource_and_printer_columns(kubectl):
    kubectl("create", "-f", "-", input=yaml.safe_dump(manifest("scaled")))
    kubectl("scale", "sm/scaled", "--replicas=3")
    assert kubectl("get", "sm", "scaled", "-o", "jsonpath={.spec.parallelism.replicas}") == "3"
    header = kubectl("get", "sm").splitlines()[0].split()
    assert header == ["NAME", "TENSOR", "PIPELINE", "REPLICAS", "READY", "PHASE", "AGE"]
    assert "replicas" in refusal(kubectl, "scale", "sm/scaled", "--replicas=-1")


def test_training_layout_fields_are_accepted_with_defaults_and_kept_by_scaling(kubectl):
    body = training_manifest(4, pipeline=4, dataParallel={"shard": 2, "replicate": 2}, schedule="Interleaved1F1B",
                             microBatches=8, gradientCompression={"method": "topk", "density": 0.05})
    body["metadata"]["name"] = "hsdp"
    training = yaml.safe_load(kubectl("create", "-o", "yaml", "-f", "-", input=yaml.safe_dump(body)))["spec"]["training"]
    assert training["dataParallel"] == {"shard": 2, "replicate": 2} and training["schedule"] == "Interleaved1F1B"
    assert training["activationCheckpointing"] is False
    assert training["gradientCompression"] == {"method": "topk", "density": 0.05, "warmupSteps": 0, "rank": 8}
    defaults = training_manifest(2, gradientCompression={})
    defaults["metadata"]["name"] = "defaults"
    training = yaml.safe_load(kubectl("create", "-o", "yaml", "-f", "-", input=yaml.safe_dump(defaults)))["spec"]["training"]
    assert (training["schedule"], training["activationCheckpointing"]) == ("1F1B", False)
    assert training["gradientCompression"] == {"method": "none", "density": 0.01, "warmupSteps": 0, "rank": 8}
    # shard x replicate fixes the replicas: the scale subresource is held to the same rule, but 0 pauses
    message = refusal(kubectl, "scale", "sm/hsdp", "--replicas=3")
    assert "spec.training.dataParallel" in message and DP_PRODUCT in message, message
    kubectl("scale", "sm/hsdp", "--replicas=0")
    assert kubectl("get", "sm", "hsdp", "-o", "jsonpath={.spec.parallelism.replicas}") == "0"


def test_autoscaling_is_accepted_with_its_defaults(kubectl):
    body = manifest("autoscaled", autoscaling={"minReplicas": 0, "maxReplicas": 3})
    spec = yaml.safe_load(kubectl("create", "--dry-run=server", "-o", "yaml", "-f", "-",
                                  input=yaml.safe_dump(body)))["spec"]
    assert spec["autoscaling"] == {"minReplicas": 0, "maxReplicas": 3, "target": "queueDepthPerReplica",
                                   "scaleDownDelaySeconds": 300, "scaleUpStabilizationSeconds": 0,
                                   "periodSeconds": 15}
    assert load_manifest(body).spec.autoscaling.value == 4
