"""Mixture-of-experts models in the planner: facts count every expert (against transformers' own
parameter count), tensor degrees must split the experts too (expert parallel runs on the tensor
group), and quantization, which does not cover expert layers yet, is refused or skipped."""
from __future__ import annotations

import pytest

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import from_hf_config
from shardwise.operator.planner import LayoutError, plan
from tests.test_planner import node

# A Mixtral-8x7B-shaped config, with 6 experts so that only some tensor degrees split them.
MIXTRAL = dict(architectures=["MixtralForCausalLM"], num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
               num_local_experts=6, num_experts_per_tok=2, torch_dtype="bfloat16")


def spec(quantization: str = "none", **parallelism) -> ShardedModelSpec:
    return ShardedModelSpec.model_validate({"model": {"uri": "/models/m"}, "parallelism": parallelism,
                                            "serving": {"quantization": quantization}})


def test_facts_count_every_expert_as_transformers_does():
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    small = dict(MIXTRAL, num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1000)
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(**{k: v for k, v in small.items() if k != "architectures"}))
    facts = from_hf_config(small)
    assert facts.experts == 6
    assert facts.params == sum(p.numel() for p in model.parameters())


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
