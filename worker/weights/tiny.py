"""A tiny random Llama in Hugging Face layout (config.json, model.safetensors, tokenizer.json).

Training and checkpoint tests, the training benchmark and the docs' first example need a model
that trains in seconds on a CPU without downloading anything: this writes one, with a byte-level
BPE tokenizer trained on the given text. Weights come from model.py's own initialisation under a
fixed seed, stored under the HF names the loader reads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def write_tiny_model(path: str | Path, text: str, *, layers: int = 4, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, vocab: int = 300, seed: int = 0,
                     tie: bool = False) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shardwise.worker.weights.hf_source import hf_name
    from shardwise.worker.model.llama import ModelConfig, Transformer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(path / "tokenizer.json"))
    n_vocab = tok.get_vocab_size()
    n_vocab += 1 - n_vocab % 2    # odd on purpose: vocabulary-parallel splits then need padding

    config = ModelConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=tie, bos_token_id=0,
                         eos_token_ids=[1])
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02 if "tok_embeddings" in name else 0.08)
    tensors = {hf_name(k): v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tie and k == "output.weight")}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": n_vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": tie,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}, indent=1))
    return path
