"""Mixture-of-experts GGUF files: a random-weight Mixtral-shaped model (arch "llama" with
llama.expert_count) and a Qwen3-MoE-shaped one (arch "qwen3moe") written as llama.cpp lays them
out (experts stacked as blk.N.ffn_{gate,up,down}_exps [E, ...], the router as ffn_gate_inp, the
Llama q/k rows interleaved for its RoPE), loaded by the worker under expert parallel x pipeline
stages: greedy tokens equal transformers' on the HF original, and a rank reads only its experts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.rank import LocalRuntime, RankSpec, generate_local, validate

from ..model.test_moe import NEW_TOKENS, PROMPTS, _moe


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (HF half-split RoPE -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str, arch: str, qtype: str = "F32") -> None:
    """The HF model in `hf_dir` as a GGUF file of `arch` ("llama" for Mixtral, "qwen3moe"), its
    decoder-layer matrices and expert stacks in `qtype` (F32 or Q8_0), the rest float32."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file
    cfg = json.load(open(f"{hf_dir}/config.json"))
    sd = {k: v.float().numpy() for k, v in load_file(f"{hf_dir}/model.safetensors").items()}
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w = GGUFWriter(path, arch)
    kind = GGMLQuantizationType[qtype]

    def matrix(name: str, a: np.ndarray) -> None:
        if qtype == "F32":
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quantize(a, kind), raw_dtype=kind)

    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_token_list([f"t{i}".encode() for i in range(cfg["vocab_size"])])
    mlp = "block_sparse_moe" if arch == "llama" else "mlp"
    names = {"w1": "gate", "w3": "up", "w2": "down"} if arch == "llama" else \
        {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":          # llama.cpp interleaves the llama arch's q/k rows only
            q, k = _permute(q, heads), _permute(k, kv)
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        matrix(f"blk.{i}.attn_q.weight", q)
        matrix(f"blk.{i}.attn_k.weight", k)
        matrix(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        matrix(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if arch == "qwen3moe":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[p + f"{mlp}.gate.weight"])
        for hf, ours in names.items():
            stack = np.stack([sd[p + f"{mlp}.experts.{j}.{hf}.weight"] for j in range(experts)])
            matrix(f"blk.{i}.ffn_{ours}_exps.weight", stack)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """name -> (GGUF path, transformers' greedy tokens on the HF original)."""
    out = {}
    for name, arch in (("8e-top2", "llama"), ("qwen3-12e-top8-norm", "qwen3moe")):
        hf_dir, ref = _moe(tmp_path_factory, name)
        path = str(tmp_path_factory.mktemp(f"gguf-{name}") / "model.gguf")
        write_gguf(hf_dir, path, arch)
        out[name] = (path, ref)
        if arch == "llama":
            quantized = str(tmp_path_factory.mktemp(f"gguf-{name}-q8") / "model.gguf")
            write_gguf(hf_dir, quantized, arch, "Q8_0")
            out[name + "-q8"] = (quantized, None)
    return out


@pytest.mark.parametrize("name,ep,pp", [("8e-top2", 1, 1), ("8e-top2", 2, 2), ("8e-top2", 4, 1),
                                        ("qwen3-12e-top8-norm", 1, 2), ("qwen3-12e-top8-norm", 4, 1)])
def test_greedy_tokens_match_transformers(ggufs, name, ep, pp):
    path, ref = ggufs[name]
    got, _ = generate_local(RankSpec(path, ep, pp, max_batch=len(PROMPTS), max_seq=64), PROMPTS, NEW_TOKENS)
    assert got == ref


def test_quantized_experts_split_alike(ggufs):
    """A Q8_0 file (blocks dequantized on load): each rank's rows of the expert stacks are whole
    blocks, so EP 4 x PP 2 gives EP 1's tokens."""
    from shardwise.worker.weights.loader import open_model
    path, _ = ggufs["8e-top2-q8"]
    assert open_model(path).dtype == "Q8_0"
    one, _ = generate_local(RankSpec(path, 1, 1, max_batch=len(PROMPTS), max_seq=64), PROMPTS, NEW_TOKENS)
    four, _ = generate_local(RankSpec(path, 4, 2, max_batch=len(PROMPTS), max_seq=64), PROMPTS, NEW_TOKENS)
    assert one == four


def test_a_rank_reads_only_its_experts(ggufs):
    path, _ = ggufs["8e-top2"]
    with LocalRuntime(RankSpec(path, 4, 1, max_batch=1, max_seq=16)) as ctx:
        ffn = ctx.stage.model.layers["0"].feed_forward
        assert ffn.w1.shape == (2, 96, 64) and ffn.w2.shape == (2, 64, 96) and ffn.expert_start == 0


def test_facts_of_a_moe_gguf_count_its_experts(ggufs):
    from pathlib import Path

    from shardwise.crds.modelshape import from_path
    mixtral, qwen3 = (from_path(Path(ggufs[name][0])) for name in ("8e-top2", "qwen3-12e-top8-norm"))
    assert (mixtral.experts, mixtral.intermediate) == (8, 96) and (qwen3.experts, qwen3.intermediate) == (12, 48)


def test_per_expert_tensors_of_older_files_are_refused_in_one_line(tmp_path):
    from gguf import GGUFWriter
    path = str(tmp_path / "old.gguf")
    w = GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16),
                       ("attention.head_count", 2), ("expert_count", 2), ("expert_used_count", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_token_list([b"a", b"b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(path))
    assert str(e.value) == (f"{path}: experts stored one tensor each (blk.0.ffn_gate.0.weight, an older "
                            f"llama.cpp layout) are not supported; convert the model again for stacked "
                            f"ffn_*_exps tensors")
