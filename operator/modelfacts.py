"""What the planner needs to know about a model: layers, heads, sizes, parameters, bytes per weight.

Read from an HF `config.json` (dict or directory), from a GGUF file's header, or from the hints in
`spec.model`. Pure Python with no torch and no numpy, because the operator image has neither: the
GGUF header is a simple length-prefixed format, so it is parsed here in a few dozen lines instead of
pulling in the `gguf` package (which needs numpy).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1}


class ModelFactsError(ValueError):
    """The model's shape could not be determined; the message says from what and why."""


@dataclass(frozen=True)
class ModelFacts:
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    intermediate: int
    params: int                    # total parameters stored (tied embeddings counted once)
    bytes_per_param: float         # weight bytes on the GPU per parameter (fractional for quantized GGUF)
    tied_embeddings: bool = False
    source: str = ""

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
        return int(self.params * self.bytes_per_param)

    def kv_bytes_per_token_per_layer(self, dtype_bytes: float = 2) -> float:
        """K and V for one token in one layer, in bytes (KV cache is kept in the activation dtype)."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes


def llama_params(layers: int, heads: int, kv_heads: int, hidden: int, intermediate: int, vocab: int,
                 tied: bool) -> int:
    head_dim = hidden // heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    mlp = 3 * hidden * intermediate                                               # gate, up, down
    layer = attention + mlp + 2 * hidden                                          # two RMSNorms
    return vocab * hidden + layers * layer + hidden + (0 if tied else vocab * hidden)


def from_hf_config(config: dict[str, Any], dtype: str = "auto", source: str = "config.json") -> ModelFacts:
    """Facts from a Hugging Face config.json (Llama-family names)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFactsError(f"{source}: missing or bad {e} (expected a Llama-family config)") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    tied = bool(config.get("tie_word_embeddings", False))
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    params = llama_params(layers, heads, kv_heads, hidden, intermediate, vocab, tied)
    return ModelFacts(layers, heads, kv_heads, hidden, vocab, intermediate, params,
                      DTYPE_BYTES.get(dtype, 2), tied, source)


# ------------------------------------------------------------------ GGUF header

# ggml tensor types -> (bytes per block, elements per block)
_GGML_BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
                9: (36, 32), 10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256),
                14: (210, 256), 15: (292, 256), 24: (1, 1), 25: (2, 1), 26: (4, 1), 27: (8, 1),
                28: (8, 1), 30: (2, 1)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ModelFactsError("GGUF header ends early")
    return struct.unpack(fmt, data)[0]


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise ModelFactsError("GGUF string length is implausible; the file is damaged")
    return f.read(n).decode("utf-8", "replace")


def _read_value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == 8:
        return _read_str(f)
    if kind == 9:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        if item_kind in _SCALARS and not keep:  # skip big arrays (token scores) without decoding
            f.seek(struct.calcsize(_SCALARS[item_kind]) * count, 1)
            return count
        items = [_read_value(f, item_kind, False) for _ in range(count)]
        return items if keep else count
    raise ModelFactsError(f"GGUF metadata value type {kind} is unknown")


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int]]]:
    """(metadata, [(tensor name, shape, ggml type)]) from a GGUF v2/v3 file, reading only its header.

    Arrays in the metadata are returned as their length (the planner needs only the vocab size).
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFactsError(f"{path}: not a GGUF file (bad magic)")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise ModelFactsError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _read_str(f)
            meta[key] = _read_value(f, _read(f, "<I"), keep=False)
        tensors = []
        for _ in range(n_tensors):
            name = _read_str(f)
            dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
            kind = _read(f, "<I")
            _read(f, "<Q")  # offset
            tensors.append((name, dims, kind))
    return meta, tensors


def from_gguf(path: str | Path) -> ModelFacts:
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture", "llama")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFactsError(f"{path}: GGUF metadata has no {arch}.{name}")
        return value

    params, weight_bytes = 0, 0.0
    for _, dims, kind in tensors:
        count = 1
        for d in dims:
            count *= d
        params += count
        block_bytes, block_elems = _GGML_BLOCKS.get(kind, (2, 1))
        weight_bytes += count * block_bytes / block_elems
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = int(meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 0)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    return ModelFacts(layers=int(key("block_count")), heads=heads,
                      kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), hidden=hidden,
                      vocab=vocab, intermediate=int(key("feed_forward_length", 4 * hidden)),
                      params=params, bytes_per_param=(weight_bytes / params if params else 2),
                      tied_embeddings=tied, source=str(path))


# ------------------------------------------------------------------ from a spec


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
                      params=model.parameters, bytes_per_param=DTYPE_BYTES.get(dtype, 2),
                      tied_embeddings=False, source="spec.model hints")


def local_path(uri: str) -> Path | None:
    """The local file or directory a uri names, if it exists on this machine."""
    if uri.startswith("pvc://"):
        return None
    path = Path(uri.removeprefix("file://")).expanduser()
    return path if path.exists() else None


def resolve(spec: Any, base: Path | None = None) -> ModelFacts:
    """Facts for a ShardedModelSpec: from the files when they are readable here, else from hints."""
    model = spec.model
    path = local_path(model.uri)
    if path is None and base is not None and not model.uri.startswith(("/", "pvc://")):
        candidate = base / model.uri
        path = candidate if candidate.exists() else None
    if path is not None:
        if model.resolved_format() == "gguf" or path.suffix == ".gguf":
            return from_gguf(path)
        config = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ModelFactsError(f"{config}: cannot read the model config ({e})") from None
        return from_hf_config(data, spec.dtype, str(config))
    return from_hints(model, spec.dtype)
