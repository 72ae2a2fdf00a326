"""A model's shape - layers, heads, sizes, parameters - and the one rule for its dtype in memory.

Read from an HF `config.json` (dict or directory), from a GGUF file's header, or from the hints in
`spec.model`. Pure Python with no torch and no numpy: the operator image has neither, and
`shardwise inspect` (crds/cli/inspect.py) runs in whichever image a probe pod uses. A GGUF file's
header is read by gguf.py, likewise torch- and numpy-free.

It lives in crds/ because both sides read it: the planner sizes a stage with it, and the worker
picks the dtype it loads weights in with `in_memory_dtype` - the same rule, so the memory the
plan promises is the memory the pod uses.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, Iterable

from shardwise.crds.apimodel import PVC_SCHEME
from shardwise.crds.gguf import GGML_TYPES, GGUFError, read_header

# HF model types whose attention normalises each query and key head (the worker: ModelConfig.qk_norm)
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# HF model types whose q, k and v projections carry biases (o has none): Qwen2 always, Qwen2-MoE
# unless its config turns qkv_bias off. See hf_qkv_bias.
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1}
# Bytes per weight of a decoder-layer matrix kept in a GGUF file's blocks (spec.serving.quantization
# gguf, the worker's --quantize gguf): the one definition of that layout's size, which the planner
# sizes pods by and worker/weights/gguf_blocks.py is tested against. The worker holds 4-bit values packed two
# a byte plus a bfloat16 scale and zero per 32-value block: 0.5 + 4/32 = 0.625 bytes for Q4_0 and
# Q4_1. Q8_0 is held as two such 4-bit planes (its high and low nibbles, each with a scale and zero
# per block): 1 + 8/32 = 1.25 bytes. Both are what torch's int4 weight-only matmul kernel takes, and
# the block-dot kernel too (worker/weights/block_dot.py: the file's float16 scale and min per block).
GGUF_NATIVE_BYTES = {"Q8_0": 1.25, "Q4_0": 0.625, "Q4_1": 0.625}
# Weight-only INT8 (spec.serving.quantization int8, the worker's --quantize int8): a scale per group
# of INT8_GROUP inputs of each row (worker/weights/quantize.py says why 32). On CUDA the worker holds
# int8 values and a bfloat16 scale per group, 1 + 2/32 = 1.0625 bytes a weight: what the planner
# sizes GPU pods by. On a CPU it holds each matrix like Q8_0 above (two 4-bit planes for torch's
# int4 kernel), INT8_CPU_BYTES.
INT8_GROUP = 32
INT8_BYTES = 1 + 2 / INT8_GROUP
INT8_CPU_BYTES = GGUF_NATIVE_BYTES["Q8_0"]


class BlockActivations(str, Enum):
    """How the worker's block-dot kernel (worker/weights/block_dot.py), which multiplies a GGUF
    file's blocks on a CPU, quantizes each matrix's input per block of 32 values (the worker's
    --block-activations)."""

    FINE = "fine"      # two int8 levels, 14 bits a value: more precise than bfloat16
    INT8 = "int8"      # one, llama.cpp's Q8: faster, and the greedy text can change


BLOCK_ACTIVATIONS = BlockActivations.FINE

# The dtypes the worker computes in (worker/weights/loader.py's DTYPES are these).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class ModelFactsError(ValueError):
    """The model's shape could not be determined; the message says from what and why."""


def in_memory_dtype(requested: str | None, model_dtype: str | None, device: str) -> str:
    """The dtype a model's weights have once loaded on `device` ("cpu" or "cuda").

    An explicit dtype wins. "auto" (or None): on CUDA the model's own dtype when the worker
    computes in it, else bfloat16 - a quantized GGUF is dequantized on load, so in memory it is as
    big as bfloat16, not as its file; on CPU float32, where 16-bit matmuls are slow or missing.
    The planner asks for "cuda" (it sizes GPUs); the worker asks for the device it runs on.
    """
    if requested and requested != "auto":
        if requested not in COMPUTE_DTYPES:
            raise ModelFactsError(f"dtype {requested!r} is not one of auto, {', '.join(COMPUTE_DTYPES)}")
        return requested
    if device.split(":")[0] != "cuda":
        return "float32"
    return model_dtype if model_dtype in COMPUTE_DTYPES else "bfloat16"


def hf_dtype(config: dict[str, Any]) -> str:
    """The dtype an HF config says its weights are stored in ("" when it does not say)."""
    return str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")


@dataclass(frozen=True)
class ModelFacts:
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    intermediate: int
    params: int                    # total parameters stored (tied embeddings counted once)
    # Bytes per parameter once loaded on a GPU: DTYPE_BYTES[in_memory_dtype(requested, dtype, "cuda")].
    bytes_per_param: float
    tied_embeddings: bool = False
    source: str = ""
    dtype: str = ""                # as stored: "bfloat16", "float32", a GGUF quantization ("Q4_1"); "" unknown
    file_bytes: int = 0            # the weights as stored (a quantized GGUF's own size); 0 unknown
    experts: int = 0               # mixture of experts: experts per layer (0: a dense model)
    shared_intermediate: int = 0   # a shared expert's intermediate size (Qwen2-MoE); 0: none
    # A GGUF file's type of the token embedding and of the LM head (the embedding's when tied), as
    # "Q8_0"; "" unknown or not a GGUF. quantized("gguf") sizes them in blocks where they are native.
    embedding_dtype: str = ""
    head_dtype: str = ""

    def tensor_fits(self, tensor: int) -> bool:
        """Whether a tensor-parallel degree splits the model: it divides the attention and KV
        heads and, for a mixture of experts, the experts (expert parallel runs on the same group)
        and the shared expert's intermediate size (split like a dense MLP's)."""
        return tensor >= 1 and self.heads % tensor == 0 and self.kv_heads % tensor == 0 \
            and (not self.experts or self.experts % tensor == 0) and self.shared_intermediate % tensor == 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.hidden and self.heads else 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm and LM head; a tied head still needs its own copy on the last stage."""
        return self.vocab * self.hidden + self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (all layers of a Llama-family model are alike)."""
        stored_outside = self.embedding_params + self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)
        return max(1, (self.params - stored_outside) // self.layers)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in GPU memory (see bytes_per_param)."""
        return int(self.params * self.bytes_per_param)

    def kv_bytes_per_token_per_layer(self, dtype_bytes: float = 2) -> float:
        """K and V for one token in one layer, in bytes (KV cache is kept in the activation dtype)."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes

    def for_dtype(self, requested: str) -> ModelFacts:
        """These facts sized for another requested dtype (a cached probe result and a changed
        spec.dtype): the stored dtype and shape stay, bytes_per_param follows the rule."""
        return replace(self, bytes_per_param=DTYPE_BYTES[in_memory_dtype(requested, self.dtype, "cuda")])

    def quantized(self, method: str) -> ModelFacts:
        """These facts sized for weight-only quantization (spec.serving.quantization). int8: the
        decoder layers' weight matrices at 1 byte a parameter plus a float32 scale per output row;
        gguf: those matrices kept in the GGUF file's own blocks, GGUF_NATIVE_BYTES[dtype] a
        parameter (scales and zeros included), for a file stored as Q8_0, Q4_0 or Q4_1, and the
        embedding and the LM head too at GGUF_NATIVE_BYTES of their own types (embedding_dtype,
        head_dtype) where those are native: the worker keeps them in blocks, a rank's vocabulary
        slice under tensor parallelism, whatever the degree. The norms, and for int8 the embedding
        and the head, stay at bytes_per_param (the compute dtype), as does an embedding or head of
        another or an unknown type. bytes_per_param becomes the average over the whole model."""
        if method in ("", "none"):
            return self
        if self.experts and method in ("int8", "gguf"):   # the worker quantizes dense layers only
            raise ModelFactsError(f"quantization {method} does not cover mixture-of-experts layers yet; use none")
        if method == "int8":
            return self._layer_matrices_at(INT8_BYTES, row_bytes=0)
        if method == "gguf":
            if self.dtype not in GGUF_NATIVE_BYTES:
                raise ModelFactsError(f"quantization gguf keeps a GGUF file's Q8_0, Q4_0 or Q4_1 blocks; "
                                      f"this model is stored as {self.dtype or 'an unknown dtype'}")
            return self._layer_matrices_at(GGUF_NATIVE_BYTES[self.dtype], row_bytes=0, vocab=True)
        raise ModelFactsError(f"quantization {method!r} is not one of none, int8, gguf")

    def _layer_matrices_at(self, element_bytes: float, row_bytes: float, vocab: bool = False) -> ModelFacts:
        """These facts with each decoder layer's weight matrices (q, k, v, o, gate, up, down) at
        `element_bytes` an element plus `row_bytes` per output row, everything else kept; with
        `vocab`, the embedding and the untied head at their GGUF types' block bytes (vocab_bytes)."""
        kept = self.bytes_per_param
        norms = 2 * self.hidden
        matrices = self.layer_params - norms
        q_rows = self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        rows = q_rows + self.hidden + 2 * self.intermediate + self.hidden   # qkv, o, gate+up, down
        per_layer = matrices * element_bytes + rows * row_bytes + norms * kept
        outside = self.params - self.layers * self.layer_params
        total = self.layers * per_layer + outside * kept
        if vocab:
            table = self.vocab * self.hidden
            tables = [self.embedding_dtype] + ([] if self.tied_embeddings else [self.head_dtype])
            total -= sum(table * (kept - self.vocab_bytes(t)) for t in tables)
        return replace(self, bytes_per_param=min(kept, total / self.params))

    def vocab_bytes(self, dtype: str) -> float:
        """Bytes an element of an embedding or LM head stored as `dtype` takes under quantization
        gguf: its blocks' where the type is kept as stored (GGUF_NATIVE_BYTES), else bytes_per_param."""
        return min(self.bytes_per_param, GGUF_NATIVE_BYTES.get(dtype, self.bytes_per_param))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only: what `shardwise inspect --json` prints and the operator caches."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ModelFacts:
        """The inverse of to_dict, checked: anything else raises ModelFactsError (one line). Keys
        it does not know are ignored, so an operator reads what a newer probe image reports."""
        if not isinstance(data, dict):
            raise ModelFactsError(f"model facts must be a JSON object, not {type(data).__name__}")
        values = {}
        for f in fields(cls):
            if f.name in data:
                values[f.name] = _checked(f.name, data[f.name], str(f.type))
            elif f.default is MISSING:
                raise ModelFactsError(f"model facts lack {f.name!r}")
        return cls(**values)


_AT_LEAST_ONE = ("layers", "heads", "kv_heads", "params")


def _checked(name: str, value: Any, kind: str) -> Any:
    """One field of a facts dict, type- and range-checked (bool is no int here, though Python says so)."""
    types = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}[kind]
    if isinstance(value, bool) != (kind == "bool") or not isinstance(value, types):
        raise ModelFactsError(f"model facts: {name} must be {kind}, not {value!r}")
    if kind in ("int", "float"):
        least = 1 if name in _AT_LEAST_ONE else 0
        if value < least or (name == "bytes_per_param" and value <= 0):
            raise ModelFactsError(f"model facts: {name} = {value!r} is out of range")
        return float(value) if kind == "float" else value
    return value


def llama_params(layers: int, heads: int, kv_heads: int, hidden: int, intermediate: int, vocab: int,
                 tied: bool, head_dim: int = 0, experts: int = 0, qk_norm: bool = False,
                 qkv_bias: bool = False, shared_intermediate: int = 0) -> int:
    """Parameters of a Llama-family model; with `experts`, each layer's MLP is that many SwiGLU
    experts of `intermediate` plus a router (Mixtral), and with `shared_intermediate` a shared
    SwiGLU expert of that size and its [1, hidden] gate too (Qwen2-MoE). `qkv_bias`: q, k and v
    have biases (Qwen2). The worker counts its models with this too."""
    head_dim = head_dim or hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    if qkv_bias:
        attention += (heads + 2 * kv_heads) * head_dim
    mlp = 3 * hidden * intermediate                                               # gate, up, down
    if experts:
        mlp = experts * mlp + hidden * experts                                    # experts, router
    if shared_intermediate:
        mlp += 3 * hidden * shared_intermediate + hidden                          # shared expert, its gate
    layer = attention + mlp + 2 * hidden + (2 * head_dim if qk_norm else 0)       # RMSNorms (Qwen3: q, k too)
    return vocab * hidden + layers * layer + hidden + (0 if tied else vocab * hidden)


def hf_qkv_bias(config: dict[str, Any]) -> bool:
    """Whether an HF config's q, k and v projections have biases (see QKV_BIAS_MODEL_TYPES)."""
    return config.get("model_type") in QKV_BIAS_MODEL_TYPES and bool(config.get("qkv_bias", True))


def hf_shared_expert_size(config: dict[str, Any]) -> int:
    """The intermediate size of an HF MoE config's shared expert (Qwen2-MoE); 0 without one."""
    if not (config.get("num_local_experts") or config.get("num_experts")):
        return 0
    return int(config.get("shared_expert_intermediate_size") or 0)


def from_hf_config(config: dict[str, Any], dtype: str = "auto", source: str = "config.json") -> ModelFacts:
    """Facts from a Hugging Face config.json (Llama-family names), sized for `dtype` on a GPU."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFactsError(f"{source}: missing or bad {e} (expected a Llama-family config)") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    # Mixtral: num_local_experts of intermediate_size; Qwen-MoE: num_experts of moe_intermediate_size
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if experts and config.get("moe_intermediate_size"):
        intermediate = int(config["moe_intermediate_size"])
    tied = bool(config.get("tie_word_embeddings", False))
    stored = hf_dtype(config)
    shared = hf_shared_expert_size(config)
    params = llama_params(layers, heads, kv_heads, hidden, intermediate, vocab, tied,
                          int(config.get("head_dim") or 0), experts,
                          config.get("model_type") in QK_NORM_MODEL_TYPES, hf_qkv_bias(config), shared)
    return ModelFacts(layers=layers, heads=heads, kv_heads=kv_heads, hidden=hidden, vocab=vocab,
                      intermediate=intermediate, params=params, experts=experts, shared_intermediate=shared,
                      bytes_per_param=DTYPE_BYTES[in_memory_dtype(dtype, stored, "cuda")],
                      tied_embeddings=tied, source=source, dtype=stored,
                      file_bytes=params * DTYPE_BYTES.get(stored, 0))


def from_hf_dir(path: Path, dtype: str = "auto") -> ModelFacts:
    """Facts from an HF model directory (or its config.json); the stored size from its safetensors."""
    config = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ModelFactsError(f"{config}: cannot read the model config ({e})") from None
    if not isinstance(data, dict):
        raise ModelFactsError(f"{config}: not a model config (a JSON object)")
    facts = from_hf_config(data, dtype, str(config))
    stored = sum(f.stat().st_size for f in config.parent.glob("*.safetensors"))
    return replace(facts, file_bytes=stored) if stored else facts


# ------------------------------------------------------------------ GGUF header

def gguf_dtype(tensors: Iterable[tuple[int, int]]) -> str:
    """The dtype a GGUF file stores most of its weights in, from (ggml type, elements) pairs:
    "Q4_1" for a Q4_1 file even though its norms are float32. The worker names its GGUF with
    this too, so both sides apply in_memory_dtype to the same name."""
    elements: dict[int, int] = {}
    for kind, count in tensors:
        elements[kind] = elements.get(kind, 0) + count
    if not elements:
        return ""
    kind = max(elements, key=lambda k: (elements[k], -k))
    return GGML_TYPES[kind][0] if kind in GGML_TYPES else f"ggml type {kind}"


def from_gguf(path: str | Path, dtype: str = "auto", limit: int | None = None) -> ModelFacts:
    """Facts from a GGUF file's header, sized for `dtype` on a GPU: the worker dequantizes, so a
    quantized file's own size is only `file_bytes`. `limit`: read at most that many bytes of the file
    (a longer header "ends early")."""
    try:
        header = read_header(path, arrays=False, limit=limit)
    except GGUFError as e:  # the reader does not know the file's name
        raise ModelFactsError(f"{path}: {e}") from None
    meta, tensors = header.metadata, header.tensors
    if not tensors:
        raise ModelFactsError(f"{path}: the GGUF file holds no tensors")
    arch = meta.get("general.architecture", "llama")

    def key(name: str, default: Any = None) -> int:
        value = meta.get(f"{arch}.{name}", default)
        if not isinstance(value, int) or isinstance(value, bool):
            # repr: the architecture is the file's own text (a newline in it stays on this line)
            raise ModelFactsError(f"{path}: GGUF metadata has no integer {f'{arch}.{name}'!r}")
        return value

    counts = [(t.ggml_type, math.prod(t.dims)) for t in tensors]
    stored = gguf_dtype(counts)
    heads, hidden = key("attention.head_count"), key("embedding_length")
    vocab = int(meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 0)
    # a mixture of experts (Mixtral as arch llama, qwen3moe): experts of expert_feed_forward_length
    # where the header gives one (Mixtral's are feed_forward_length)
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    intermediate = key("feed_forward_length", 4 * hidden)
    if experts and meta.get(f"{arch}.expert_feed_forward_length"):
        intermediate = key("expert_feed_forward_length")
    types = {t.name: GGML_TYPES[t.ggml_type][0] if t.ggml_type in GGML_TYPES else "" for t in tensors}
    embedding = types.get("token_embd.weight", "")
    return ModelFacts(layers=key("block_count"), heads=heads, experts=experts,
                      kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), hidden=hidden,
                      vocab=vocab, intermediate=intermediate,
                      params=sum(count for _, count in counts),
                      bytes_per_param=DTYPE_BYTES[in_memory_dtype(dtype, stored, "cuda")],
                      tied_embeddings="output.weight" not in types,
                      source=str(path), dtype=stored, file_bytes=sum(_stored_bytes(k, c) for k, c in counts),
                      embedding_dtype=embedding, head_dtype=types.get("output.weight", embedding))


def _stored_bytes(kind: int, count: int) -> int:
    _, block_bytes, block_elements = GGML_TYPES.get(kind, ("", 2, 1))  # an unknown type: guess 16 bits
    return count * block_bytes // block_elements


# ------------------------------------------------------------------ from a spec or a path


def from_hints(model: Any, dtype: str = "auto") -> ModelFacts:
    """Facts from spec.model hints (parameters, layers, heads, kvHeads, hiddenSize, vocabSize)."""
    missing = [name for name, value in (("parameters", model.parameters), ("layers", model.layers),
                                        ("heads", model.heads)) if not value]
    if missing:
        raise ModelFactsError(f"cannot read the model at {model.uri} here; set spec.model."
                              + ", spec.model.".join(missing) + " so the planner can size it")
    hidden = model.hidden_size or 0
    vocab = model.vocab_size or 0
    return ModelFacts(layers=model.layers, heads=model.heads, kv_heads=model.kv_heads or model.heads,
                      hidden=hidden, vocab=vocab, intermediate=model.intermediate_size or 4 * hidden,
                      params=model.parameters, bytes_per_param=DTYPE_BYTES[in_memory_dtype(dtype, None, "cuda")],
                      tied_embeddings=False, source="spec.model hints")


def local_path(uri: str) -> Path | None:
    """The local file or directory a uri names, if it exists on this machine."""
    if uri.startswith(PVC_SCHEME):
        return None
    path = Path(uri.removeprefix("file://")).expanduser()
    return path if path.exists() else None


def model_file(path: Path, gguf: bool = False) -> tuple[Path, bool]:
    """What a local model is read from, and whether it is a GGUF file: a directory without a
    config.json must hold exactly one .gguf file; anything else is read as it is named."""
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelFactsError(f"{path}: not a model (expected a .gguf file or a directory with config.json)")
        return ggufs[0], True
    return path, gguf or path.suffix == ".gguf"


def from_path(path: Path, dtype: str = "auto", gguf: bool = False) -> ModelFacts:
    """Facts from a local model: a .gguf file (or a directory holding just one), an HF directory
    or its config.json. OSErrors (a directory where a file was expected...) become ModelFactsError."""
    try:
        path, gguf = model_file(path, gguf)
        if gguf:
            return from_gguf(path, dtype)
        return from_hf_dir(path, dtype)
    except OSError as e:
        raise ModelFactsError(f"{path}: cannot read the model ({e.strerror or e})") from None


def resolve(spec: Any, base: Path | None = None) -> ModelFacts:
    """Facts for a ShardedModelSpec: from the files when they are readable here, else from hints."""
    model = spec.model
    path = local_path(model.uri)
    if path is None and base is not None and not model.uri.startswith(("/", PVC_SCHEME)):
        candidate = base / model.uri
        path = candidate if candidate.exists() else None
    if path is not None:
        return from_path(path, spec.dtype, gguf=model.resolved_format() == "gguf")
    return from_hints(model, spec.dtype)
