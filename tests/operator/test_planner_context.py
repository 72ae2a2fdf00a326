"""Context parallelism in the plan: the C ranks of a sequence are replicas, ZeRO-3 shards over
dataParallel.shard x C of them, and an elastic or shrunk job runs whole sequences only."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.operator.cli.plan import table
from shardwise.operator.decide import elastic
from shardwise.operator.planning import groups as planning
from shardwise.operator.planning.layouts import GiB, LayoutError, PlanError
from shardwise.operator.planning.planner import plan
from shardwise.operator.render import renderer
from tests.operator.test_decide import Cluster, rack, training
from tests.operator.test_planner_zero import LLAMA_8B, expected_memory, nodes, training_spec


def test_the_ranks_of_a_sequence_always_shard_among_themselves():
    """GPUs this large hold Llama 8B unsharded; with C = 2 or 4 its state is sharded over C at least
    (FSDP shards over dp_shard x cp), and the GPUs are the same: one per replica."""
    assert plan(training_spec(8), LLAMA_8B, nodes(1, 10_000)).data_shard == 1
    for context in (2, 4):
        result = plan(training_spec(8, contextParallel=context), LLAMA_8B, nodes(1, 10_000))
        assert (result.context, result.data_shard, result.data_replicate) == (context, context, 8 // context)
        assert result.memory_per_gpu == expected_memory(LLAMA_8B, 1, 1, context, training_spec(8, contextParallel=context))
        assert len(result.placements) == 8 and {p.gpus for p in result.placements} == {1}
        assert any(n.startswith(f"context parallel: each sequence split over {context} replicas "
                                f"({64 // context} of its 64 tokens each") for n in result.notes), result.notes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences=st.integers(1, 8), context=st.sampled_from([1, 2, 4]), memory_gib=st.sampled_from([24, 40, 80, 141]),
       pipeline=st.sampled_from([1, 2]))
def test_the_chosen_shard_is_the_smallest_multiple_of_c_dividing_the_replicas_that_fits(sequences, context,
                                                                                          memory_gib, pipeline):
    replicas = sequences * context
    inventory = nodes(replicas * pipeline // 8 + 1, memory_gib)
    degrees = [d for d in range(context, replicas + 1, context) if replicas % d == 0]     # brute force
    spec = training_spec(replicas, 1, pipeline, contextParallel=context)
    fitting = [d for d in degrees if expected_memory(LLAMA_8B, 1, pipeline, d, spec) <= 0.9 * memory_gib * GiB]
    if not fitting:
        with pytest.raises(PlanError):
            plan(spec, LLAMA_8B, inventory)
        return
    result = plan(spec, LLAMA_8B, inventory)
    assert (result.data_shard, result.context) == (fitting[0], context)
    assert result.memory_per_gpu == expected_memory(LLAMA_8B, 1, pipeline, fitting[0], spec)


@pytest.mark.parametrize("data_parallel, shard", [({"shard": 2}, 4), ({"replicate": 2}, 4), ({"shard": 1}, 2),
                                                  ({"shard": 4, "replicate": 1}, 8)])
def test_a_shard_degree_the_spec_gives_counts_the_ranks_of_a_sequence(data_parallel, shard):
    result = plan(training_spec(8, contextParallel=2, dataParallel=data_parallel), LLAMA_8B, nodes(1, 10_000))
    assert (result.data_shard, result.data_replicate) == (shard, 8 // shard)
    assert f"ZeRO-3 over dataParallel.shard {shard // 2} × 2" in " ".join(result.notes)


def test_a_spec_the_api_did_not_check_is_refused_in_one_line():
    spec = training_spec(4, contextParallel=2)
    odd = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"replicas": 3})})
    with pytest.raises(LayoutError) as e:
        plan(odd, LLAMA_8B, nodes(1, 80))
    assert str(e.value) == ("training.contextParallel 2 does not divide parallelism.replicas 3: "
                            "the ranks of a sequence are replicas")


def test_a_shrunk_plan_runs_whole_sequences():
    """Room for 3 of 4 replicas: without context parallelism it runs 3, with C = 2 it runs 2 and says why."""
    def shrinking(**training):
        spec = training_spec(4, **training)
        return spec.model_copy(update={"recovery": spec.recovery.model_copy(update={"allow_shrink": True})})
    assert plan(shrinking(), LLAMA_8B, nodes(1, 80, gpus=3)).replicas == 3
    result = plan(shrinking(contextParallel=2), LLAMA_8B, nodes(1, 80, gpus=3))
    assert result.shrunk and (result.replicas, result.data_shard, result.context) == (2, 2, 2)
    assert any(n.startswith("shrunk to 2 of 4 replica(s) (a multiple of training.contextParallel 2): ")
               for n in result.notes), result.notes
    with pytest.raises(PlanError):      # room for one replica: not one whole sequence
        plan(shrinking(contextParallel=2), LLAMA_8B, nodes(1, 80, gpus=1))


def test_sequence_parallelism_is_judged_on_the_tokens_a_context_rank_holds():
    ok = plan(training_spec(2, tensor=2, contextParallel=2, sequenceParallel=True, seqLength=64), LLAMA_8B,
              nodes(1, 80))
    assert any("(16 of 32 tokens each)" in n for n in ok.notes), ok.notes
    bad = plan(training_spec(2, tensor=8, contextParallel=2, sequenceParallel=True, seqLength=36), LLAMA_8B,
               nodes(1, 80, gpus=16))
    assert any("cannot split the 18 tokens of seqLength / contextParallel over tensor 8" in n for n in bad.notes)


def test_another_context_degree_is_another_layout():
    result = plan(training_spec(4, contextParallel=2), LLAMA_8B, nodes(1, 10_000))
    assert planning.layout_matches(result, training_spec(4, contextParallel=2))
    assert not planning.layout_matches(result, training_spec(4))
    assert not planning.layout_matches(plan(training_spec(4), LLAMA_8B, nodes(1, 10_000)),
                                       training_spec(4, contextParallel=2))


def test_the_plan_table_shows_the_context_degree():
    result = plan(training_spec(4, contextParallel=2), LLAMA_8B, nodes(1, 10_000))
    assert table(result).splitlines()[0].startswith("tensor 1 × pipeline 1 × 4 replica(s) (context parallel 2: "
                                                    "2 data-parallel); ")
    assert "context" not in table(plan(training_spec(4), LLAMA_8B, nodes(1, 10_000))).splitlines()[0]


# ------------------------------------------------------------------ elastic: whole sequences only

@pytest.mark.parametrize("replicas, floor, training_fields, sizes", [
    (6, 1, {}, [6, 5, 4, 3, 2, 1]),
    (6, 1, {"contextParallel": 2}, [6, 4, 2]),
    (8, 1, {"contextParallel": 2, "dataParallel": {"shard": 2}}, [8, 4]),        # ZeRO-3 over 4 replicas
    (12, 3, {"contextParallel": 3, "seqLength": 60}, [12, 9, 6, 3]),
    (4, 1, {"contextParallel": 4}, [4]),
])
def test_an_elastic_job_runs_only_sizes_that_hold_whole_sequences(replicas, floor, training_fields, sizes):
    assert elastic.sizes(training_spec(replicas, minReplicas=floor, **training_fields)) == sizes


def test_a_smaller_size_keeps_the_asked_shard_and_context_degrees():
    spec = training_spec(8, minReplicas=1, contextParallel=2, dataParallel={"shard": 2})
    smaller = elastic.at_size(spec, 4)
    assert smaller.training.data_parallel.shard == 2 and smaller.context_parallel() == 2
    result = plan(smaller, LLAMA_8B, nodes(1, 10_000))
    assert (result.replicas, result.data_shard, result.context) == (4, 4, 2)
    assert planning.layout_matches(result, spec)


def test_a_shrunk_job_says_which_sizes_it_may_run_at():
    spec = training_spec(6, minReplicas=1, contextParallel=2)
    assert elastic.shrunk_note(spec, 4, "no room") == (
        "running 4 of 6 replicas (minReplicas 1; only multiples of 2: training.contextParallel 2): no room")
    assert elastic.shrunk_note(training_spec(6, minReplicas=1), 5, "no room") == (
        "running 5 of 6 replicas (minReplicas 1): no room")


def test_an_elastic_context_parallel_job_short_of_capacity_runs_whole_sequences_and_says_so():
    """4 replicas of 4 GPUs, C = 2, minReplicas 1, room for 3: the operator runs 2 (one sequence's
    worth of data parallelism), and its Event and condition say why not 3."""
    spec = training(replicas=4)
    spec["training"] = {**spec["training"], "minReplicas": 1, "contextParallel": 2}
    c = Cluster(spec, rack("n0", "a", gpus=8) + rack("n1", "b", gpus=4))
    c.reconcile()
    contract = json.loads(renderer.configmap_contract(c.configmap))
    assert (contract["plan"]["replicas"], contract["plan"]["context"], contract["plan"]["shrunk"]) == (2, 2, True)
    assert contract["training"]["context_parallel"] == 2 and len(c.replica_pods()) == 2
    shrunk = [e.message for e in c.events if e.reason == "Shrunk"]
    assert shrunk and shrunk[-1].startswith(
        "running 2 of 4 replicas (minReplicas 1; only multiples of 2: training.contextParallel 2): "), shrunk


# ------------------------------------------------------------------ the pods

def test_a_context_parallel_model_renders_one_world_of_its_replicas_pods():
    """contextParallel 2 over 4 replicas of tensor 2: 4 pods of 2 GPUs (8 ranks: C x D x T = 2 x 2 x 2),
    one rendezvous, and the C in the contract every pod reads (plan.context and training)."""
    from shardwise.crds.contract import PodContract
    from shardwise.crds.models import ShardedModel
    spec = training_spec(4, tensor=2, contextParallel=2)
    result = plan(spec, LLAMA_8B, nodes(1, 10_000))
    model = ShardedModel(metadata={"name": "job", "namespace": "ns", "uid": "u"}, spec=spec)
    pods = [p for r in range(4) for p in renderer.render_replica_pods(model, result, r, 0)]
    assert len(pods) == 4
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["shardwise", "worker"] and container["args"][:1] == ["--contract"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    contract = PodContract.from_json(renderer.configmap_contract(renderer.render_configmap(model, result)))
    assert (contract.plan.context, contract.plan.data_shard, contract.training.context_parallel) == (2, 2, 2)
    # without it, the plan and the spec are written as before: no pod of an existing job rolls
    plain = training_spec(4, tensor=2)
    assert "context" not in plan(plain, LLAMA_8B, nodes(1, 10_000)).model_dump()
    assert "context_parallel" not in plain.model_dump()["training"]
    assert renderer.spec_hash(plain) != renderer.spec_hash(spec)


def test_a_new_context_degree_restarts_the_job_on_a_new_plan_and_says_so():
    c = Cluster(training(replicas=4), rack("n0 n1", "a"))
    c.ready()
    c.edit(training={"data": "/data/text.txt", "steps": 100, "contextParallel": 2})
    c.reconcile()
    told = [e.message for e in c.events if e.reason == "Restarting"]
    assert told and told[-1].startswith("layout changed from TP=4 PP=1 CP=1 to TP=4 PP=1 CP=2"), told
    c.reconcile()
    contract = json.loads(renderer.configmap_contract(c.configmap))
    assert (contract["plan"]["context"], contract["plan"]["data_shard"], contract["training"]["context_parallel"]) == (
        2, 2, 2)
    assert len(c.replica_pods()) == 4
