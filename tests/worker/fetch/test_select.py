"""Which files and byte ranges one pipeline stage needs (pure functions over a model's metadata)."""
from __future__ import annotations

import json

import pytest

from shardwise.crds.gguf import read_header
from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch.cache import CacheError, safe_name
from shardwise.worker.fetch.remote import RemoteFile
from shardwise.worker.fetch.select import StageShare, gguf_stage_ranges, metadata_files, stage_share, weight_files

CONFIG = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 301,
          "intermediate_size": 128, "num_key_value_heads": 2}


def model_folder(tmp_path, tied=False):
    weight_map = {"model.embed_tokens.weight": "e.safetensors", "model.norm.weight": "h.safetensors"}
    if not tied:
        weight_map["lm_head.weight"] = "h.safetensors"
    for i in range(4):
        weight_map[f"model.layers.{i}.self_attn.q_proj.weight"] = f"l{i}.safetensors"
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "tie_word_embeddings": tied}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    listing = [RemoteFile(n, 10) for n in ("config.json", "model.safetensors.index.json", "README.md",
                                            "e.safetensors", "h.safetensors", *(f"l{i}.safetensors" for i in range(4)))]
    return listing


def test_each_stage_gets_its_layers_with_the_embedding_first_and_the_head_last(tmp_path):
    listing = model_folder(tmp_path)
    assert [f.name for f in metadata_files(listing)] == ["config.json", "model.safetensors.index.json"]
    shares = [stage_share(tmp_path, s, 2) for s in range(2)]
    files = [{f.name for f in weight_files(listing, tmp_path, s)} for s in shares]
    cut = shares[0].layers[1]
    assert files[0] == {"e.safetensors", *(f"l{i}.safetensors" for i in range(cut))}
    assert files[1] == {"h.safetensors", *(f"l{i}.safetensors" for i in range(cut, 4))}
    # The plan's own split wins over the default one.
    assert {f.name for f in weight_files(listing, tmp_path, stage_share(tmp_path, 1, 2, (3, 4)))} == \
        {"h.safetensors", "l3.safetensors"}


def test_a_tied_head_brings_the_embedding_to_the_last_stage(tmp_path):
    listing = model_folder(tmp_path, tied=True)
    last = stage_share(tmp_path, 1, 2)
    assert "e.safetensors" in {f.name for f in weight_files(listing, tmp_path, last)}


def test_an_index_pointing_outside_the_folder_or_at_a_missing_file_is_one_line(tmp_path):
    listing = model_folder(tmp_path)
    share = stage_share(tmp_path, 0, 1)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../etc/passwd"}}))
    with pytest.raises(WorkerError, match="not a file of the model's folder"):
        weight_files(listing, tmp_path, share)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(WorkerError, match="'gone.safetensors', which the store does not hold"):
        weight_files(listing, tmp_path, share)
    with pytest.raises(WorkerError, match="no config.json"):
        metadata_files([RemoteFile("model.safetensors", 1)])


def test_gguf_ranges_cover_the_header_and_the_stages_tensors(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(4)
    writer.add_tensor("token_embd.weight", np.ones((50, 64), dtype=np.float32))
    for layer in range(4):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.full((64, 64), layer, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones((64,), dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((50, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header, size = read_header(path), path.stat().st_size
    offsets = {t.name: t.offset for t in header.tensors}
    first = gguf_stage_ranges(header, size, StageShare(0, 2, (0, 2)))
    last = gguf_stage_ranges(header, size, StageShare(1, 2, (2, 4)))
    # Stage 0: header + embedding + layers 0-1 in one run; stage 1: header, then layers 2-3 and the head.
    assert first == [(0, offsets["blk.2.attn_q.weight"])]
    assert last == [(0, offsets["token_embd.weight"]), (offsets["blk.2.attn_q.weight"], size)]
    assert sum(e - s for s, e in first) < size and sum(e - s for s, e in last) < size


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "", "a\\b", "a\0b", "x" * 2000])
def test_the_cache_refuses_names_that_leave_the_entry(name):
    with pytest.raises(CacheError) as e:
        safe_name(name)
    assert "refusing file name" in str(e.value) and "\n" not in str(e.value)
