"""A GGUF file as a model source (llama architecture, Mixtral's included, or qwen3moe): the config
from its metadata, and a rank's rows read from the memory-mapped file (gguf_index), dequantized with
the `gguf` package, or kept as stored blocks for `--quantize gguf` (gguf_blocks)."""
from __future__ import annotations

import math
import os
import re

import numpy as np
import torch

from shardwise.crds.gguf import GGUFError
from shardwise.crds.modelshape import gguf_dtype

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.llama import ModelConfig
from shardwise.worker.distributed.tensor_parallel import Shard
from shardwise.worker.weights.gguf_index import GGUFIndex
from shardwise.worker.weights.source import ModelSource, pad_rows

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


def _reverse_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows (it converts HF's half-split RoPE layout)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(ModelSource):
    """A GGUF file (llama architecture, Mixtral's included, or qwen3moe); quantized tensors are
    dequantized to float32."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.index = GGUFIndex(path)
        except GGUFError as e:  # the header reader's own words, one line
            raise WorkerError(f"weight file {path} is not a valid GGUF file: {e}") from None
        except Exception as e:  # noqa: BLE001 - the gguf package's errors (an unknown ggml type)
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
        return pad_rows(out, shard, shape[0])

    def read_blocks(self, name: str, shard: Shard | None):
        """This rank's slice of a weight matrix as the file's blocks (gguf_blocks.Blocks), not
        dequantized: its rows (a vocabulary slice of the embedding or head included, padded as
        `read` pads it) or whole blocks of its columns; None where the tensor's type has no fast
        path (gguf_blocks.NATIVE) or a column slice would cut a block (the caller then reads it
        with `read`)."""
        from gguf import GGMLQuantizationType
        from shardwise.worker.weights.gguf_blocks import NATIVE, Blocks
        g = _gguf_name(name)
        t = self.tensors.get("token_embd.weight" if g == "output.weight" and g not in self.tensors else g)
        qtype = GGMLQuantizationType(t.qtype).name if t is not None else ""
        if qtype not in NATIVE or len(t.shape) != 2:
            return None
        blocks = Blocks(qtype, self.index.data(t.name))
        if shard is not None and shard.dim == 1:
            start, stop = shard.bounds(t.shape[1])
            blocks = blocks.columns(start, min(stop, t.shape[1]))
        elif shard is not None:
            # a run of whole rows; a vocabulary slice (shard.padded) past the last row is zero rows
            start, stop = shard.bounds(t.shape[0])
            blocks = blocks.rows(start, stop)
        if blocks is None:
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
