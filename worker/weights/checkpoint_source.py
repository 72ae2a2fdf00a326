"""A training checkpoint as a model for `--model`: the model config from its meta.json, and each
read fetching only the rank's slice of a tensor from the DCP files (checkpoint_format)."""
from __future__ import annotations

import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.llama import ModelConfig
from shardwise.worker.distributed.tensor_parallel import Shard
from shardwise.worker.weights.checkpoint_format import CheckpointError, Slice, read_slices, resolve, stored_shapes
from shardwise.worker.weights.source import ModelSource


class CheckpointSource(ModelSource):
    """A training checkpoint as a model for `--model`: each read fetches only the rank's slice."""

    def __init__(self, path: str):
        folder, meta = resolve(path)
        self.path = str(folder)
        self.meta = meta
        self.config = ModelConfig.from_dict(meta["model_config"])
        self.shapes = stored_shapes(folder)

    def check(self) -> None:
        missing = [k for k in ("model/norm.weight", "model/tok_embeddings.weight") if k not in self.shapes]
        if missing:
            raise CheckpointError(f"checkpoint {self.path} lacks {missing[0]}")

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:
        key = name
        if name == "output.weight" and f"model/{name}" not in self.shapes and self.config.tie_word_embeddings:
            key = "tok_embeddings.weight"
        full = self.shapes.get(f"model/{key}")
        if full is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
        if shard is None:
            out = torch.empty(full, dtype=torch.float32)
            read_slices(self.path, {f"model/{key}": Slice.whole(out)})
            return out
        start, stop = shard.bounds(full[shard.dim])
        real = max(0, min(stop, full[shard.dim]) - start)
        shape = list(full)
        shape[shard.dim] = stop - start
        out = torch.zeros(shape, dtype=torch.float32)   # rows past the vocabulary stay zero
        if real:
            part = out.narrow(shard.dim, 0, real)
            offsets = tuple(start if d == shard.dim else 0 for d in range(len(full)))
            read_slices(self.path, {f"model/{key}": Slice(part, tuple(full), offsets)})
        return out


def open_checkpoint_model(path: str) -> CheckpointSource:
    """A checkpoint folder (or a run's checkpoint root) as a ModelSource; its errors as WorkerError."""
    try:
        return CheckpointSource(path)
    except CheckpointError as e:
        raise WorkerError(str(e)) from None
