"""Greedy tokens of the sharded runtime == Hugging Face transformers' on the same weights.

Every layout is a real launch: TP x PP processes talking gloo on loopback. Three prompts of
different lengths are submitted together, so batched decode with per-row positions and (for PP > 1)
several micro-batches in flight through the stages are exercised too.
"""
from __future__ import annotations

import os

import pytest
import torch

from shardwise.worker.serving.rank import RankSpec, generate_local

NEW_TOKENS = 6
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]

# name -> LlamaConfig overrides: GQA ratios 1/2/4, odd layer counts, tied and untied heads,
# vocabularies that do not split evenly, Llama-3 RoPE scaling, explicit head_dim.
SHAPES = {
    "gqa2_untied_5layers": dict(num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4,
                                hidden_size=64, intermediate_size=96, vocab_size=257, tie_word_embeddings=False),
    "gqa4_tied_llama3rope": dict(num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=4,
                                 hidden_size=64, intermediate_size=80, vocab_size=301, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}),
    "mha_headdim_7layers": dict(num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=4,
                                hidden_size=48, head_dim=16, intermediate_size=64, vocab_size=199,
                                tie_word_embeddings=False),
}

# Every layout of TP {1,2,4} x PP {1,2,3} runs the first shape; the others run on a spread of
# layouts, so each shape meets TP > 1 and PP > 1 without 27 launches.
CASES = [(s, "gqa2_untied_5layers") for s in [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (4, 1), (4, 2), (4, 3)]]
CASES += [((2, 3), "gqa4_tied_llama3rope"), ((4, 2), "gqa4_tied_llama3rope"), ((1, 3), "gqa4_tied_llama3rope")]
CASES += [((4, 3), "mha_headdim_7layers"), ((2, 2), "mha_headdim_7layers"), ((1, 1), "mha_headdim_7layers")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, HF greedy continuations of PROMPTS). Written as several safetensors shards."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = {}
    for i, (name, overrides) in enumerate(SHAPES.items()):
        torch.manual_seed(i)
        cfg = LlamaConfig(max_position_embeddings=64, **overrides)
        hf = LlamaForCausalLM(cfg).eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, max_shard_size="60KB")
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
        refs = []
        with torch.no_grad():
            for p in PROMPTS:
                g = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
                refs.append(g[0, len(p):].tolist())
        out[name] = (str(path), refs)
    return out


def run_layout(model: str, tp: int, pp: int, prompts, new_tokens: int):
    return generate_local(RankSpec(model, tp, pp, max_batch=4, max_seq=64), prompts, new_tokens)


@pytest.mark.parametrize("layout,shape", CASES, ids=[f"tp{t}-pp{p}-{s}" for (t, p), s in CASES])
def test_random_llama_matches_transformers(models, layout, shape):
    path, refs = models[shape]
    got, loaded = run_layout(path, *layout, PROMPTS, NEW_TOKENS)
    assert got == refs
    assert len(loaded) == layout[0] * layout[1]


def test_tp2_rank_holds_half_the_weights(models):
    path, _ = models["gqa2_untied_5layers"]
    _, one = run_layout(path, 1, 1, PROMPTS[:1], 1)
    _, two = run_layout(path, 2, 1, PROMPTS[:1], 1)
    full = one[0]["weight_bytes"]
    for rank in two:
        # Only the two RMSNorm vectors per layer and the final norm are replicated.
        assert 0.49 < rank["weight_bytes"] / full < 0.52, (rank, full)
