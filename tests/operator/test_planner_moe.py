"""Mixture-of-experts models in the planner: facts count every expert (against transformers' own
parameter count), tensor degrees must split the experts too (expert parallel runs on the tensor
group), and quantization, which does not cover expert layers yet, is refused or skipped."""
from __future__ import annotations

import pytest

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.planning.planner import LayoutError, plan
from tests.operator.builders import gpu_node as node

# A Mixtral-8x7B-shaped config, with 6 experts so that only some tensor degrees split them.
MIXTRAL = dict(architectures=["MixtralForCausalLM"], num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
               num_local_experts=6, num_experts_per_tok=2, torch_dtype="bfloat16")


def spec(quantization: str = "none", **parallelism) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({"model": {"uri": "/models/m"}, "parallelism": parallelism,
                                            "serving": {"quantization": quantization}})


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "qwen2"])
def test_facts_count_every_expert_as_transformers_does(family):
    import torch
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    small = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, hidden_size=256,
                 intermediate_size=512, vocab_size=1000, num_experts_per_tok=2)
    if family == "mixtral":
        config = MixtralConfig(**small, num_local_experts=6)
        build = MixtralForCausalLM
    elif family == "qwen3_moe":   # its own expert width, q/k norms, a head_dim other than hidden / heads
        config = Qwen3MoeConfig(**small, num_experts=6, moe_intermediate_size=128, head_dim=64)
        build = Qwen3MoeForCausalLM
    elif family == "qwen2_moe":   # a shared expert of its own width and its gate, q/k/v biases
        config = Qwen2MoeConfig(**small, num_experts=6, moe_intermediate_size=128, shared_expert_intermediate_size=384)
        build = Qwen2MoeForCausalLM
    else:                         # dense, q/k/v biases
        config = Qwen2Config(**{k: v for k, v in small.items() if k != "num_experts_per_tok"})
        build = Qwen2ForCausalLM
    with torch.device("meta"):
        model = build(config)
    facts = from_hf_config(config.to_dict())
    assert facts.experts == (0 if family == "qwen2" else 6)
    assert facts.shared_intermediate == (384 if family == "qwen2_moe" else 0)
    assert facts.params == sum(p.numel() for p in model.parameters())


def test_a_tensor_degree_that_does_not_split_the_shared_expert_is_one_line():
    qwen = dict(MIXTRAL, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_local_experts=None,
                num_experts=8, moe_intermediate_size=1408, shared_expert_intermediate_size=5636)
    facts = from_hf_config(qwen)
    with pytest.raises(LayoutError) as e:
        plan(spec(tensor=8), facts, [node("n1", 8, memory_gib=80)])
    assert str(e.value) == ("parallelism.tensor 8 does not divide the model's 5636 shared expert width "
                            "(intermediate size, split like a dense MLP); use one of 1, 2, 4")
    assert plan(spec(), facts, [node("n1", 8, memory_gib=80)]).tensor in (1, 2, 4)


def test_the_chosen_tensor_degree_splits_the_experts():
    facts = from_hf_config(MIXTRAL)
    result = plan(spec(), facts, [node("n1", 8, memory_gib=80)])
    assert 6 % result.tensor == 0 and result.tensor > 1      # ~90 GiB of bf16 weights: more than one GPU


def test_a_tensor_degree_that_does_not_split_the_experts_is_one_line():
    with pytest.raises(LayoutError) as e:
        plan(spec(tensor=4), from_hf_config(MIXTRAL), [node("n1", 8, memory_gib=80)])
    assert str(e.value) == ("parallelism.tensor 4 does not divide the model's 6 experts (expert parallel "
                            "splits them over the tensor group); use one of 1, 2")


def test_quantization_is_not_offered_for_experts_yet():
    facts = from_hf_config(MIXTRAL)
    with pytest.raises(LayoutError, match="quantization int8 does not cover mixture-of-experts layers yet"):
        plan(spec("int8"), facts, [node("n1", 8, memory_gib=80)])
    assert plan(spec("auto"), facts, [node("n1", 8, memory_gib=80)]).quantization == "none"


def test_parallelism_expert_is_the_tensor_degree():
    nodes = [node("n1", 8, memory_gib=80)]
    facts = from_hf_config(MIXTRAL)
    assert plan(spec(expert=2), facts, nodes).tensor == 2
    with pytest.raises(ValueError, match="parallelism.expert 2 must equal parallelism.tensor 3"):
        spec(expert=2, tensor=3)
    with pytest.raises(LayoutError) as e:
        plan(spec(expert=4), facts, nodes)
    assert "does not divide the model's 6 experts" in str(e.value)
    dense = from_hf_config({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"})
    with pytest.raises(LayoutError) as e:
        plan(spec(expert=2), dense, nodes)
    assert str(e.value) == ("parallelism.expert 2 is for mixture-of-experts models; this model has no experts "
                            "(use parallelism.tensor)")
