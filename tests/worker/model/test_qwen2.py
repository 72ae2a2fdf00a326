"""Dense Qwen2 (q/k/v projection biases): greedy tokens of the sharded runtime == transformers' on
the same random weights, under TP {1, 2} and a pipeline of 2, with the fused and the INT8 paths;
and a bias survives every matrix kind that stands in for a fused q/k/v (inference.InferenceLinear,
quantize.Int8Linear, gguf_blocks.BlockLinear). Real processes talking torch.distributed."""
from __future__ import annotations

import pytest
import torch

from shardwise.worker.serving.rank import LocalRuntime, RankSpec, generate_local

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(directory, transformers' greedy continuations): GQA 2, untied head, a vocabulary that does
    not split evenly, and biases large enough to change the tokens (transformers starts them at 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(7)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                      tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 1e6})).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.uniform_(-1, 1)
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path)
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return str(path), refs


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_greedy_tokens_match_transformers(qwen2, tp, pp):
    path, refs = qwen2
    got, loaded = generate_local(RankSpec(path, tp, pp, max_batch=4, max_seq=64), PROMPTS, NEW_TOKENS)
    assert got == refs
    assert len(loaded) == tp * pp


def test_a_rank_holds_its_rows_of_the_biases(qwen2):
    """Under TP 2 each rank's fused q/k/v bias is its heads' rows of q, k and v, in that order."""
    from safetensors import safe_open
    path, _ = qwen2
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        q, k, v = (f.get_tensor(f"model.layers.0.self_attn.{p}_proj.bias") for p in "qkv")
    with LocalRuntime(RankSpec(path, 2, 1, max_batch=1, max_seq=16)) as ctx:
        bias = ctx.stage.model.layers["0"].attention.wqkv.bias        # rank 0: the first half of each
    assert torch.equal(bias, torch.cat([q[:q.numel() // 2], k[:k.numel() // 2], v[:v.numel() // 2]]))


def test_int8_keeps_the_bias(qwen2):
    """--quantize int8 on a biased model: close to the float model (the same first tokens)."""
    path, refs = qwen2
    got, _ = generate_local(RankSpec(path, 2, 1, max_batch=4, max_seq=64, quantize="int8"), PROMPTS, 2)
    assert sum(g[0] == r[0] for g, r in zip(got, refs)) >= 2


def test_every_fused_matrix_kind_adds_the_bias():
    import numpy as np
    from gguf.quants import quantize
    from gguf import GGMLQuantizationType

    from shardwise.worker.weights.gguf_blocks import Blocks, BlockLinear
    from shardwise.worker.model.inference import InferenceLinear
    from shardwise.worker.weights.quantize import Int8Linear
    torch.manual_seed(0)
    w, b, x = torch.randn(32, 64), torch.randn(32), torch.randn(3, 64)
    want = x @ w.t() + b
    lin = InferenceLinear(w, b)
    assert torch.allclose(lin.mm(x), want, atol=1e-5)
    assert torch.allclose(lin(x.view(1, 3, 64)), want.view(1, 3, 32), atol=1e-5)
    int8 = Int8Linear.replacing(lin)          # the int4 kernel's planes where it runs (bfloat16 activations)
    want8 = x @ int8.dequantized().t() + b
    tol = 0.02 * float(want8.abs().max())
    assert torch.allclose(int8.mm(x[:1]), want8[:1], atol=tol) and torch.allclose(int8.mm(x), want8, atol=tol)
    blocks = Blocks("Q8_0", np.asarray(quantize(w.numpy(), GGMLQuantizationType.Q8_0)))
    plain, biased = BlockLinear(blocks), BlockLinear(blocks, bias=b)
    assert torch.allclose(biased.mm(x), plain.mm(x) + b, atol=1e-5)
    assert torch.equal(biased.dequantized(), plain.dequantized())        # the matrix alone
