"""The model formats a `--model` argument may name, and the one way to open one.

Every format is a source in this package: a training checkpoint (checkpoint_source), a GGUF file
(gguf_source) and an HF safetensors directory (hf_source). `detect_format(path)` names the format of
a path, the first match in FORMATS winning; `open_model(spec)` resolves a `--model` value (builtin)
and returns its checked source. Training checkpoints are listed here, not added by the training
code, so that every process that opens a model (a serving rank started by a fork server included)
knows them without importing training.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.builtin import resolve_model
from shardwise.worker.weights.checkpoint_format import is_checkpoint
from shardwise.worker.weights.checkpoint_source import open_checkpoint_model
from shardwise.worker.weights.gguf_source import GGUFSource
from shardwise.worker.weights.hf_source import HFSource
from shardwise.worker.weights.source import ModelSource


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[str], bool]
    open: Callable[[str], ModelSource]


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _is_hf(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


# A checkpoint folder also holds config.json (the model's files travel with it): it is tried first.
FORMATS = (Format("checkpoint", is_checkpoint, open_checkpoint_model), Format("gguf", _is_gguf, GGUFSource),
           Format("hf", _is_hf, HFSource))


def detect_format(path: str) -> str:
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt.name
    if os.path.isdir(path):
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if len(ggufs) == 1:
            return "gguf"
    raise WorkerError(f"{path}: not a model (expected a .gguf file or a directory with config.json)")


def open_model(spec: str) -> ModelSource:
    """`--model` value -> a checked source (config parsed, the weight files present complete; a
    stage's own files all there is loader.check_stage's check)."""
    path = resolve_model(spec)
    name = detect_format(path)
    if name == "gguf" and os.path.isdir(path):
        path = os.path.join(path, next(f for f in os.listdir(path) if f.endswith(".gguf")))
    source = next(f for f in FORMATS if f.name == name).open(path)
    source.check()
    return source
