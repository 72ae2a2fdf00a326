"""Capacity from the plan: the concurrency the planner derives from the KV cache it sized, the spec
fields that override it and the other serving settings (bounded, one-line refusals, the same rule
as a CEL rule), and the pod contract that carries every setting resolved to the worker."""
from __future__ import annotations

import pytest

from shardwise.crds import capacity
from shardwise.crds.contract import PodContract
from shardwise.crds.models import PlanSummary, ShardedModel, ShardedModelSpec, load_manifest
from shardwise.crds.schema import crd
from shardwise.operator.planning.planner import plan
from shardwise.operator.render import renderer
from shardwise.worker.cli import flags, pod, serve
from tests.api.test_contract import SMOL, _mounted, _nodes
from tests.api.test_models import minimal


def _model(**serving) -> ShardedModel:
    return ShardedModel(metadata={"name": "smol", "namespace": "prod", "uid": "u-1"},
                        spec=ShardedModelSpec.model_validate({
                            "model": {"uri": "/models/smollm2"}, "dtype": "bfloat16", "serving": serving,
                            "parallelism": {"tensor": 3, "pipeline": 1, "replicas": 1}}))


@pytest.mark.parametrize("serving, sequences, why", [
    ({}, 16, "8192 KV-cache tokens / 512 tokens a sequence"),                      # the default cache
    ({"kvCacheTokens": 16384}, 32, "16384 KV-cache tokens / 512"),
    ({"kvCacheTokens": 16384, "maxModelLength": 128}, 128, "16384 KV-cache tokens / 128"),
    ({"kvCacheTokens": 10 ** 7}, capacity.MAX_DERIVED_SEQUENCES, "between 1 and 256"),
    ({"kvCacheTokens": 100}, 1, "100 KV-cache tokens"),
    ({"kvCacheTokens": 0}, capacity.MAX_BATCH, "kvCacheTokens 0"),
    ({"kvCacheTokens": 16384, "maxConcurrentRequests": 5}, 5, "(serving.maxConcurrentRequests)"),
])
def test_the_plan_derives_the_concurrency_from_the_kv_cache_it_sized(serving, sequences, why):
    planned = plan(_model(**serving).spec, SMOL, _nodes())
    assert planned.max_sequences == sequences
    assert any(n.startswith(f"{sequences} sequences at once per replica") and why in n for n in planned.notes)
    assert PlanSummary.from_plan(planned).to_api()["maxSequences"] == sequences


def test_the_pods_contract_carries_every_serving_setting_resolved(tmp_path):
    model = _model(kvCacheTokens=16384)
    planned = plan(model.spec, SMOL, _nodes())
    contract = pod.read_contract(str(_mounted(renderer.render_configmap(model, planned), tmp_path)))
    s = contract.serving
    assert (s.max_concurrent_requests, s.max_waiting, s.kv_cache_tokens, s.kv_block_size, s.prefill_chunk,
            s.decode.value, s.max_model_length) == (32, capacity.max_waiting(32), 16384, capacity.KV_BLOCK_SIZE,
                                                    capacity.PREFILL_CHUNK, "auto", None)
    # what the worker's engine is built with: the contract's, unless a flag is given
    args = _pod_args()
    assert flags.serving_settings(args, pod.contract_settings(s)) == {
        "max_batch": 32, "max_seq": 0, "kv_tokens": 16384, "kv_block": 16, "prefill_chunk": 512, "decode": "auto"}
    given = _pod_args("--max-batch", "3", "--decode", "eager", "--kv-cache-tokens", "0")
    settings = flags.serving_settings(given, pod.contract_settings(s))
    assert (settings["max_batch"], settings["decode"], settings["kv_tokens"], settings["kv_block"]) == (3, "eager", 0, 16)

    asked = _model(kvCacheTokens=4096, maxConcurrentRequests=40, maxWaiting=7, maxModelLength=2048,
                   kvBlockSize=32, prefillChunk=64, decode="compile")
    s = PodContract.from_json(renderer.pod_contract(asked, plan(asked.spec, SMOL, _nodes())).to_json()).serving
    assert (s.max_concurrent_requests, s.max_waiting, s.max_model_length, s.kv_block_size, s.prefill_chunk,
            s.decode.value) == (40, 7, 2048, 32, 64, "compile")


def test_a_contract_written_before_the_settings_existed_reads_with_them_derived(tmp_path):
    model = _model(kvCacheTokens=16384)
    old = renderer.pod_contract(model, plan(model.spec, SMOL, _nodes())).model_dump(mode="json")
    del old["plan"]["max_sequences"]
    for field in ("max_concurrent_requests", "max_waiting", "kv_block_size", "prefill_chunk", "decode",
                  "max_model_length"):
        del old["serving"][field]
    s = PodContract.model_validate(old).serving
    assert (s.max_concurrent_requests, s.max_waiting, s.kv_block_size) == (32, 128, 16)


def _pod_args(*given: str):
    import argparse
    parser = argparse.ArgumentParser()
    pod.add_arguments(parser)
    return parser.parse_args(["--contract", "c.json", *given])


@pytest.mark.parametrize("serving, message", [
    ({"maxConcurrentRequests": 0}, "spec.serving.maxConcurrentRequests: Input should be greater than or equal to 1"),
    ({"maxConcurrentRequests": 4097}, "spec.serving.maxConcurrentRequests: Input should be less than or equal to 4096"),
    ({"maxWaiting": 0}, "spec.serving.maxWaiting: Input should be greater than or equal to 1"),
    ({"maxWaiting": 10 ** 6}, "spec.serving.maxWaiting: Input should be less than or equal to 16384"),
    ({"kvBlockSize": 4096}, "spec.serving.kvBlockSize: Input should be less than or equal to 1024"),
    ({"prefillChunk": 0}, "spec.serving.prefillChunk: Input should be greater than or equal to 1"),
    ({"kvCacheTokens": 2 ** 30}, "spec.serving.kvCacheTokens: Input should be less than or equal to 16777216"),
    ({"decode": "fast"}, "spec.serving.decode: Input should be 'auto', 'eager', 'graphs' or 'compile'"),
    ({"maxModelLength": 9000}, "serving.maxModelLength must not exceed serving.kvCacheTokens"),
])
def test_bad_serving_settings_are_refused_in_one_line_naming_the_field(serving, message):
    with pytest.raises(ValueError) as e:
        load_manifest(minimal(serving=serving))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_context_rule_is_a_cel_rule_with_the_same_words_and_a_context_within_the_cache_is_accepted():
    serving = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["serving"]
    assert [r["message"] for r in serving["x-kubernetes-validations"]] == [capacity.CONTEXT_OVER_CACHE]
    assert load_manifest(minimal(serving={"maxModelLength": 8192})).spec.serving.max_model_length == 8192
    assert load_manifest(minimal(serving={"maxModelLength": 9000, "kvCacheTokens": 0})).spec.serving.kv_cache_tokens == 0


def test_one_definition_of_each_default_the_worker_and_the_planner_read():
    """The worker's flags state the constants the planner and the contract resolve with (torch-free:
    RankSpec's defaults are the same constants, tests/worker/cli/test_flags.py)."""
    import argparse
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    help_of = {flag: a.help for a in parser._actions for flag in a.option_strings}
    assert f"{capacity.WAITING_PER_ROW} x --max-batch, at least {capacity.MIN_WAITING}" in help_of["--max-waiting"]
    for flag, value in (("--max-batch", capacity.MAX_BATCH), ("--kv-block-size", capacity.KV_BLOCK_SIZE),
                        ("--prefill-chunk", capacity.PREFILL_CHUNK), ("--max-seq-len", capacity.DEFAULT_CONTEXT)):
        assert str(value) in help_of[flag], flag
    assert ShardedModelSpec.model_validate({"model": {"uri": "/m"}}).serving.kv_cache_tokens == capacity.KV_CACHE_TOKENS


def test_spec_hash_keeps_existing_pods_unless_a_setting_is_given():
    base = renderer.spec_hash(_model().spec)
    assert renderer.spec_hash(_model(decode="auto").spec) == base
    assert renderer.spec_hash(_model(maxConcurrentRequests=64).spec) != base
    assert renderer.spec_hash(_model(decode="eager").spec) != base
