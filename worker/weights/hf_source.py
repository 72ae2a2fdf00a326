"""A Hugging Face model directory as a model source: config.json (llama, Mixtral, Qwen2, Qwen2-MoE,
Qwen3-MoE), model.safetensors or sharded files with their index, read slice by slice
(safetensors' `get_slice`), so a rank reads only the rows or columns it holds."""
from __future__ import annotations

import os
from typing import Iterable

import torch

from shardwise.crds.modelshape import QK_NORM_MODEL_TYPES, QKV_BIAS_MODEL_TYPES, hf_dtype, hf_qkv_bias, hf_shared_expert_size

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.llama import ModelConfig
from shardwise.worker.distributed.tensor_parallel import Shard
from shardwise.worker.weights import json_file
from shardwise.worker.weights.safetensors_header import tensor_names
from shardwise.worker.weights.source import ModelSource, pad_rows

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM")


# The HF names of a mixture-of-experts layer, by model_type: its router, and expert j's w1 (gate),
# w3 (up) and w2 (down), which moe.MoEFeedForward stacks along the expert dimension. (Qwen2-MoE's
# shared expert has fixed names: hf_name's table.)
_QWEN_EXPERTS = ("mlp.gate.weight", "mlp.experts.{j}.{w}.weight", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
_HF_MOE = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.{w}.weight",
                       {"w1": "w1", "w3": "w3", "w2": "w2"}),
           "qwen2_moe": _QWEN_EXPERTS, "qwen3_moe": _QWEN_EXPERTS}


def hf_name(name: str, arch: str = "llama") -> str:
    """model.py's parameter name -> the HF checkpoint's ('layers.3.attention.wq.weight' ->
    'model.layers.3.self_attn.q_proj.weight'); tiny.write_tiny_model stores its weights by it."""
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "model.embed_tokens.weight"
    if parts[0] == "norm":
        return "model.norm.weight"
    if parts[0] == "output":
        return "lm_head.weight"
    i, rest = parts[1], ".".join(parts[2:])
    if rest == "feed_forward.router.weight":
        return f"model.layers.{i}.{_HF_MOE[arch][0]}"
    table = {"attention_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
             "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
             "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
             "attention.wv.bias": "self_attn.v_proj.bias",
             "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
             "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
             "feed_forward.w2.weight": "mlp.down_proj.weight",
             "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
             "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
             "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
             "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight"}
    return f"model.layers.{i}.{table[rest]}"


def _hf_expert_names(name: str, arch: str, first: int, stop: int) -> list[str] | None:
    """'layers.3.feed_forward.w1' -> the HF names of experts first..stop-1; None for other names."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "layers" or parts[2] != "feed_forward" or parts[3] not in ("w1", "w3", "w2"):
        return None
    _, pattern, names = _HF_MOE[arch]
    return [f"model.layers.{parts[1]}." + pattern.format(j=j, w=names[parts[3]]) for j in range(first, stop)]

def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if archs[0] not in SUPPORTED_ARCHITECTURES and cfg.get("model_type") != "llama":
        raise WorkerError(f"{where}: unsupported architecture {archs[0]!r} "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("model_type") not in QKV_BIAS_MODEL_TYPES and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        # Llama's attention_bias puts a bias on o_proj too, which a row-parallel split would add
        # once per rank; only q/k/v biases (Qwen2's) are carried.
        raise WorkerError(f"{where}: attention/MLP biases are not supported (only Qwen2's q/k/v biases are)")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True):
        raise WorkerError(f"{where}: sliding-window attention (sliding_window {cfg['sliding_window']}) "
                          f"is not supported")
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos,
            architecture=cfg.get("model_type") or "llama", qk_norm=cfg.get("model_type") in QK_NORM_MODEL_TYPES,
            attention_bias=hf_qkv_bias(cfg), **_moe_fields(cfg, where))
    except KeyError as e:
        raise WorkerError(f"{where}: config.json lacks {e.args[0]!r}") from None


def _moe_fields(cfg: dict, where: str) -> dict:
    """ModelConfig's mixture-of-experts fields from an HF config (Mixtral, Qwen2-MoE, Qwen3-MoE);
    {} for a dense model. (transformers writes a Qwen3-MoE's num_experts as num_local_experts too.)"""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return {}
    if cfg.get("model_type") == "mixtral":               # experts of intermediate_size, always renormalised
        return {"num_experts": experts, "experts_per_token": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    # Every layer must be a mixture of experts (transformers: layer i is one when it is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0).
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise WorkerError(f"{where}: decoder_sparse_step {cfg['decoder_sparse_step']} (dense MLP layers between "
                          f"the expert layers) is not supported; only 1, every layer a mixture of experts")
    if cfg.get("mlp_only_layers"):
        raise WorkerError(f"{where}: mlp_only_layers {cfg['mlp_only_layers']} (dense MLP layers among the "
                          f"expert layers) is not supported; only [], every layer a mixture of experts")
    return {"num_experts": experts, "experts_per_token": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": hf_shared_expert_size(cfg)}


def _weight_map(index: str, path: str) -> dict[str, str]:
    """A sharded model's index: tensor name -> its file, which must be a file name in the model's
    own directory (an index is the download's word: "../" or an absolute path is refused)."""
    weight_map = json_file.read_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise WorkerError(f"{index} has no weight_map object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise WorkerError(f"{index}: tensor {name!r} is in {str(file)[:80]!r}, not a file of {path}")
    return {name: os.path.join(path, file) for name, file in weight_map.items()}


class HFSource(ModelSource):
    """A Hugging Face model directory: config.json, model.safetensors or sharded files + index."""

    def __init__(self, path: str):
        self.path = path
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise WorkerError(f"{path}: no config.json")
        self.raw_config = json_file.read_object(cfg_path)
        self.config = config_from_hf(self.raw_config, path)
        self.dtype = hf_dtype(self.raw_config)
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            eos = json_file.read_object(gen).get("eos_token_id")
            for e in ([eos] if isinstance(eos, int) else eos or []):
                if e not in self.config.eos_token_ids:
                    self.config.eos_token_ids.append(e)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            self.weight_map = _weight_map(index, path)
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            self.weight_map = None
            self._single = os.path.join(path, "model.safetensors")
        else:
            raise WorkerError(f"{path}: no model.safetensors or model.safetensors.index.json")
        if self.weight_map is not None and "lm_head.weight" not in self.weight_map:
            self.config.tie_word_embeddings = True   # no separate head stored: it is the embedding
        self._handles: dict[str, object] = {}

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values())) if self.weight_map else [self._single]

    def check(self) -> None:
        """The weight files present are whole (their headers read). A sharded model's file the
        index lists may be absent: a pipeline stage fetched from a store holds only the files of
        its own tensors (fetch/select.py). A stage that reads an absent file is refused by
        `require` before its ranks start, and by `_file` when it is read."""
        present = [f for f in self.files() if os.path.isfile(f)]
        if not present:
            raise WorkerError(f"weight file {self.files()[0]} is missing (listed in the index), and so is "
                              f"every other weight file of {self.path}")
        for f in present:
            names = tensor_names(f)
            if self.weight_map is None:
                self.weight_map = {n: f for n in names}
        if "lm_head.weight" not in self.weight_map and not self.config.tie_word_embeddings:
            raise WorkerError(f"{self.path}: lm_head.weight is missing and embeddings are not tied")

    def require(self, names: Iterable[str]) -> None:
        """WorkerError (one line, naming the file) if a file holding one of these model.py
        parameters (a stage's, every expert of a layer) is absent."""
        arch = self.config.architecture
        for name in names:
            experts = _hf_expert_names(name, arch, 0, self.config.num_experts) if self.config.num_experts else None
            for hf in experts or [self._stored(hf_name(name, arch))]:
                self._path(hf)

    def _stored(self, hf: str) -> str:
        """The checkpoint's name for `hf`: a tied LM head stored only as the embedding is that."""
        if hf == "lm_head.weight" and self.config.tie_word_embeddings and hf not in (self.weight_map or {}):
            return "model.embed_tokens.weight"
        return hf

    def _path(self, hf_name: str) -> str:
        """The file holding tensor `hf_name`, which must be present."""
        if self.weight_map is None:
            self.check()
        if hf_name not in self.weight_map:
            raise WorkerError(f"{self.path}: tensor {hf_name} is missing from the weights")
        fname = self.weight_map[hf_name]
        if fname not in self._handles and not os.path.isfile(fname):
            raise WorkerError(f"weight file {fname} is missing (listed in the index for {hf_name}, "
                              f"which is to be loaded)")
        return fname

    def _file(self, hf_name: str):
        from safetensors import safe_open
        fname = self._path(hf_name)
        if fname not in self._handles:
            self._handles[fname] = safe_open(fname, framework="pt")
        return self._handles[fname]

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:
        arch = self.config.architecture
        if self.config.num_experts:
            # A stack of experts [E, ...]: only this rank's experts' tensors are read.
            first, stop = shard.bounds(self.config.num_experts) if shard is not None else (0, self.config.num_experts)
            experts = _hf_expert_names(name, arch, first, stop)
            if experts is not None:
                return torch.stack([self._file(n).get_tensor(n) for n in experts])
        hf = self._stored(hf_name(name, arch))
        sl = self._file(hf).get_slice(hf)
        if shard is None:
            return sl[:]
        full = sl.get_shape()[shard.dim]
        start, stop = shard.bounds(full)
        stop = min(stop, full)
        t = sl[start:stop] if shard.dim == 0 else sl[:, start:stop]
        return pad_rows(t, shard, full)
