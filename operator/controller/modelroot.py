"""The model root: the one folder of the operator's own file system it reads models from.

A ShardedModel's spec.model.uri is a tenant's string. The operator opens nothing it names except
inside the root the chart configures (`operator run --model-root DIR`, $SHARDWISE_MODEL_ROOT;
empty, the default: no root, nothing is read). Inside the root:
  - the path is resolved (symlinks too) and must stay inside it; a path outside is not an error, it
    is simply not the operator's to read: the model-shape probe reads it where the pods would;
  - only regular files are opened (never a device such as /dev/zero, a FIFO, a socket), without
    blocking, and each read is capped (a config.json at CONFIG_MAX_BYTES, a GGUF header at
    GGUF_HEADER_MAX_BYTES);
  - what it read is cached by the files' identity (size, modification time), so a pass costs a stat.
The result is facts, the one-line reason they cannot be had, or None (not under the root: probe it).
"""
from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path
from typing import Any

from shardwise.crds import boundedjson
from shardwise.crds.modelshape import (ModelFacts, ModelFactsError, from_gguf, from_hf_config, from_hints,
                                       model_file)

ROOT = ""                         # set by `operator run --model-root`; "" reads nothing
CONFIG_MAX_BYTES = 1 << 20        # an HF config.json is a few KiB
GGUF_HEADER_MAX_BYTES = 64 << 20  # a GGUF header with a 256k-token vocabulary is a few MiB


def read(spec: Any, root: str | None = None) -> ModelFacts | str | None:
    """The model's facts when its uri is inside the model root, the one-line reason they cannot be
    read there, or None when it is not the operator's to read (no root, pvc://, hf://, s3://, oci://,
    outside the root)."""
    root = ROOT if root is None else root
    model = spec.model
    if not root or model.pvc() is not None or model.remote_scheme():
        return None   # a claim, or a store: only a pod reads it (never the operator's own network)
    base = os.path.realpath(root)
    raw = model.uri.removeprefix("file://")
    path = os.path.realpath(os.path.join(base, raw))   # an absolute uri replaces the base
    if os.path.commonpath([base, path]) != base:
        return None
    try:
        if not os.path.lexists(path):
            return from_hints(model, spec.dtype)        # "cannot read the model at <uri> here; set ..."
        return _facts(Path(path), spec.dtype, model.resolved_format() == "gguf", _identity(path))
    except ModelFactsError as e:
        return str(e)
    except OSError as e:
        return f"{model.uri}: cannot read the model ({e.strerror or e})"


def _identity(path: str) -> tuple:
    """What changes when the files read change: the path's and its config.json's size and mtime."""
    marks = []
    for p in (path, os.path.join(path, "config.json")):
        try:
            st = os.stat(p)
            marks.append((st.st_size, st.st_mtime_ns, st.st_mode))
        except OSError:
            marks.append(None)
    return tuple(marks)


@functools.lru_cache(maxsize=256)
def _facts(path: Path, dtype: str, gguf: bool, identity: tuple) -> ModelFacts:
    """Facts of a model inside the root (cached by `identity`): a .gguf file (or a directory holding
    just one), an HF directory or its config.json."""
    del identity   # the cache key only
    path, gguf = model_file(path, gguf)
    if gguf:
        _regular(path)
        return from_gguf(path, dtype, limit=GGUF_HEADER_MAX_BYTES)
    config = path / "config.json" if path.is_dir() else path
    facts = from_hf_config(_read_json(config), dtype, str(config))
    stored = sum(f.stat().st_size for f in config.parent.glob("*.safetensors") if f.is_file())
    return ModelFacts(**{**facts.__dict__, "file_bytes": stored}) if stored else facts


def _regular(path: Path) -> None:
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ModelFactsError(f"{path}: not a regular file")


def _read_json(path: Path) -> dict:
    """A config.json: a regular file, opened without blocking (a FIFO), at most CONFIG_MAX_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelFactsError(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(CONFIG_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > CONFIG_MAX_BYTES:
        raise ModelFactsError(f"{path}: larger than {CONFIG_MAX_BYTES} bytes; not a model config")
    try:
        config = boundedjson.loads(data, boundedjson.MODEL_JSON_DEPTH)
    except ValueError as e:
        raise ModelFactsError(f"{path}: cannot read the model config ({e})") from None
    if not isinstance(config, dict):
        raise ModelFactsError(f"{path}: not a model config (a JSON object)")
    return config
