"""The pods of a model fetched from where it lives (hf://, s3://, oci://): their credentials, the
cache they fetch into and the contract's source block, for each scheme (pure rendering)."""
from __future__ import annotations

import json

import pytest

from shardwise.crds import names
from shardwise.crds.contract import PodContract
from shardwise.crds.models import ShardedModel, ShardedModelSpec
from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
from shardwise.operator.decide import probe
from shardwise.operator.render import renderer
from shardwise.operator.render.settings import Settings

METADATA = {"name": "llama", "namespace": "team-a", "uid": "uid-1", "generation": 1}
SETTINGS = Settings(model_cache_host_path="/mnt/nvme/cache/", model_cache_budget=500 << 30)
HINTS = {"parameters": 10**6, "layers": 4, "heads": 8}


def _model(**model) -> ShardedModel:
    spec = {"model": {**HINTS, **model}, "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1}}
    return ShardedModel(metadata=METADATA, spec=ShardedModelSpec.model_validate(spec))


def _plan() -> ShardPlan:
    return ShardPlan(tensor=1, pipeline=1, replicas=1, num_layers=4, groups=[ReplicaPlan(replica=0)],
                     placements=[StagePlacement(replica=0, stage=0, node="n0", gpus=1, layer_start=0,
                                                layer_end=4, embedding=True, head=True)])


def _pod(model: ShardedModel, settings: Settings = SETTINGS) -> dict:
    return renderer.render_replica_pods(model, _plan(), 0, 0, settings=settings)[0]


def _contract(model: ShardedModel, settings: Settings = SETTINGS) -> PodContract:
    cm = renderer.render_configmap(model, _plan(), settings)
    return PodContract.from_json(renderer.configmap_contract(cm))


SCHEMES = [
    ("s3", {"uri": "s3://models/smollm2", "endpoint": "http://minio.storage:9000", "region": "us-east-1",
            "pathStyle": True}, ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]),
    ("hf", {"uri": "hf://HuggingFaceTB/SmolLM2-135M@main"}, ["HF_TOKEN"]),
    ("oci", {"uri": "oci://registry.local:5000/models/smollm2:v1"}, ["OCI_USERNAME", "OCI_PASSWORD"]),
]


@pytest.mark.parametrize("scheme, model, keys", SCHEMES)
def test_a_remote_models_pod_gets_only_its_schemes_credential_keys_from_the_secret(scheme, model, keys):
    pod = _pod(_model(**model, credentialsRef={"name": "store-creds"}))
    worker = pod["spec"]["containers"][0]
    secret_env = [e for e in worker["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert [e["name"] for e in secret_env] == keys
    for e in secret_env:
        assert e["valueFrom"]["secretKeyRef"] == {"name": "store-creds", "key": e["name"], "optional": True}
    assert "envFrom" not in worker, "a Secret's own key names must never become variables"


@pytest.mark.parametrize("scheme, model, keys", SCHEMES)
def test_a_remote_models_pod_mounts_its_namespaces_node_cache_and_the_contract_says_where(scheme, model, keys):
    m = _model(**model)
    pod = _pod(m)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
    assert volume["hostPath"] == {"path": "/mnt/nvme/cache/team-a", "type": "DirectoryOrCreate"}
    mount = next(v for v in pod["spec"]["containers"][0]["volumeMounts"] if v["name"] == "model-cache")
    assert mount["mountPath"] == names.MODEL_CACHE_MOUNT
    # a non-root worker can write it: its group gets the directory
    assert names.WORKER_GID in pod["spec"]["securityContext"]["supplementalGroups"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["prepare-model-cache"]
    source = _contract(m).source
    assert (source.uri, source.scheme, source.cache.value, source.cache_dir, source.cache_budget) == (
        model["uri"], scheme, "node", names.MODEL_CACHE_MOUNT, 500 << 30)
    assert (source.endpoint, source.region, source.path_style) == (
        model.get("endpoint"), model.get("region"), model.get("pathStyle"))


def test_no_credential_and_no_secret_name_is_in_the_contract():
    m = _model(uri="s3://models/smollm2", credentialsRef={"name": "store-creds"})
    text = renderer.configmap_contract(renderer.render_configmap(m, _plan(), SETTINGS)).decode()
    assert "store-creds" not in text and "AWS_" not in text


@pytest.mark.parametrize("model, settings", [
    ({"uri": "s3://models/smollm2", "cache": "pod"}, SETTINGS),
    ({"uri": "hf://org/name"}, Settings(model_cache_host_path="")),   # the operator's cache is off
])
def test_a_pod_cache_is_an_emptydir_with_no_root_init_container(model, settings):
    m = _model(**model)
    pod = _pod(m, settings)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-cache")
    assert volume == {"name": "model-cache", "emptyDir": {}}
    assert "initContainers" not in pod["spec"] and not any("hostPath" in v for v in pod["spec"]["volumes"])
    assert pod["spec"]["securityContext"] == renderer.WORKER_POD_SECURITY   # still Pod Security restricted
    source = _contract(m, settings).source
    assert (source.cache.value, source.cache_budget) == ("pod", None)


def test_a_model_in_a_path_or_claim_renders_as_before():
    m = _model(uri="pvc://weights/llama")
    pod = _pod(m)
    assert not any(v["name"] == "model-cache" for v in pod["spec"]["volumes"])
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in pod["spec"]["containers"][0]["env"])
    text = renderer.configmap_contract(renderer.render_configmap(m, _plan(), SETTINGS))
    assert "source" not in json.loads(text), "an older worker image must still read the contract"
    # and the spec hash is the one it had before the remote options existed (computed by that code):
    # upgrading the operator rolls no pod
    for spec, before in (({"model": {"uri": "pvc://weights/llama"}}, "f375e8f053"),
                         ({"model": {"uri": "/models/x.gguf", "layers": 4}, "serving": {"port": 8080},
                           "parallelism": {"tensor": 2}}, "0e7fc67de3")):
        assert renderer.spec_hash(ShardedModelSpec.model_validate(spec)) == before


def test_changing_where_a_model_is_fetched_from_rolls_its_pods():
    base = _model(uri="s3://models/smollm2")
    moved = _model(uri="s3://models/smollm2", endpoint="https://s3.internal:443")
    keyed = _model(uri="s3://models/smollm2", credentialsRef={"name": "other"})
    assert len({renderer.spec_hash(m.spec) for m in (base, moved, keyed)}) == 3


def test_fetch_streams_reach_the_pods_contract_and_restart_no_pod():
    plain, streamed = _model(uri="oci://registry.local:5000/models/tiny:v1"), _model(
        uri="oci://registry.local:5000/models/tiny:v1", fetchStreams=3)
    assert _contract(streamed).source.streams == 3
    assert _contract(plain).source.streams is None
    text = json.loads(renderer.configmap_contract(renderer.render_configmap(plain, _plan(), SETTINGS)))
    assert "streams" not in text["source"], "an older worker image must still read the contract"
    # the pods are the same: setting, changing or unsetting it rolls nothing (the next pod started reads it)
    assert renderer.spec_hash(plain.spec) == renderer.spec_hash(streamed.spec)
    assert _pod(plain)["metadata"]["labels"] == _pod(streamed)["metadata"]["labels"]


def test_the_probe_of_a_remote_model_reads_the_store_itself_with_the_models_credentials():
    m = _model(uri="s3://models/smollm2", endpoint="http://minio:9000", region="eu-1", pathStyle=True,
               credentialsRef={"name": "store-creds"})
    container = probe.render(m, "op/worker:1")["spec"]["containers"][0]
    assert container["command"][:3] == ["shardwise", "inspect", "s3://models/smollm2"]
    assert container["command"][-3:] == ["--endpoint=http://minio:9000", "--region=eu-1", "--path-style"]
    assert [e["name"] for e in container["env"]] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                     "AWS_SESSION_TOKEN"]
    assert container["image"] == "op/worker:1"   # the operator's code, never spec.image


def test_only_a_registry_the_operator_lists_gets_plain_http_in_the_pods_contract_probe_and_pre_pull():
    """The cluster admin's --plain-http-registry list (compared case-insensitively, port included) is
    the one way to plain HTTP: the spec has no field for it, and no other registry's pods get it."""
    from dataclasses import replace

    from shardwise.operator.render import prepull
    listed = replace(SETTINGS, plain_http_registries=("models.registry.svc:5000",))
    model = _model(uri="oci://Models.Registry.svc:5000/llama:v1", prePull=True)
    other_port = _model(uri="oci://models.registry.svc:5001/llama:v1", prePull=True)

    def probe_command(m, settings):
        return probe.render(m, "op/worker:1", settings)["spec"]["containers"][0]["command"]

    def prepull_command(m, settings):
        return prepull.render(m, _plan(), 0, 0, "n0", "op/worker:1", settings)["spec"]["containers"][0]["command"]

    assert _contract(model, listed).source.plain_http is True
    assert "--plain-http" in probe_command(model, listed) and "--plain-http" in prepull_command(model, listed)
    for m, settings in ((other_port, listed), (model, SETTINGS)):
        assert _contract(m, settings).source.plain_http is None
        assert "--plain-http" not in probe_command(m, settings) + prepull_command(m, settings)
    text = json.loads(renderer.configmap_contract(renderer.render_configmap(model, _plan(), SETTINGS)))
    assert "plain_http" not in text["source"], "an older worker image must still read the contract"


@pytest.mark.parametrize("argv", [["--plain-http-registry=http://registry:5000"],
                                  ["--plain-http-registry=registry:99999"]])
def test_the_operator_refuses_a_plain_http_registry_that_is_not_a_host_and_port_in_one_line(argv):
    import argparse

    from shardwise.operator.cli import run
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    with pytest.raises(run._Refused, match="is not a registry's HOST") as e:
        run._render_settings(parser.parse_args(["run", *argv]))
    assert "\n" not in str(e.value)


def test_the_operator_never_reads_a_remote_uri_itself_even_under_its_model_root(tmp_path):
    from shardwise.operator.controller import modelroot
    (tmp_path / "hf:").mkdir()   # a folder the uri would name if it were taken for a path
    spec = ShardedModelSpec.model_validate({"model": {"uri": "hf://org/name"}})
    assert modelroot.read(spec, root=str(tmp_path)) is None, "no facts, no error: the probe pod reads it"


@pytest.mark.parametrize("argv, refused", [
    (["--model-cache-host-path=/var/lib/shardwise", "--local-checkpoint-root=/var/lib/shardwise/checkpoints"],
     "overlaps --local-checkpoint-root"),
    (["--model-cache-host-path=/data/ckpt/cache", "--local-checkpoint-root=/data/ckpt"], "overlaps"),
    (["--model-cache-host-path=var/cache"], "must be an absolute path without '..'"),
    (["--model-cache-host-path=/var/../etc"], "must be an absolute path without '..'"),
    (["--model-cache-budget=lots"], "--model-cache-budget: 'lots' is not a quantity"),
])
def test_the_operator_refuses_a_cache_root_that_could_expose_checkpoints_in_one_line(argv, refused):
    import argparse

    from shardwise.operator.cli import run
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    with pytest.raises(run._Refused) as e:
        run._render_settings(parser.parse_args(["run", *argv]))
    assert refused in str(e.value) and "\n" not in str(e.value)


def test_the_operator_takes_a_cache_root_apart_from_the_checkpoint_roots():
    import argparse

    from shardwise.operator.cli import run
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    got = run._render_settings(parser.parse_args(["run", "--model-cache-host-path=/mnt/cache//", "--model-cache-budget=2Ti"]))
    assert (got.model_cache_host_path, got.model_cache_budget) == ("/mnt/cache", 2 << 40)
