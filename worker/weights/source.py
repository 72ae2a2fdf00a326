"""What a loader needs from a model format: the ModelSource interface every format implements
(hf_source, gguf_source, checkpoint_source), and the padding of a vocabulary-parallel slice they
share."""
from __future__ import annotations

from typing import Iterable

import torch

from shardwise.worker.model.llama import ModelConfig
from shardwise.worker.distributed.tensor_parallel import Shard


class ModelSource:
    """What a loader needs from a format: the config, tensors by model.py name, the tokenizer."""
    config: ModelConfig
    path: str
    dtype: str = ""    # as stored ("bfloat16", "Q4_1"); "" unknown. in_memory_dtype picks the run dtype from it

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def check(self) -> None:
        """Raise WorkerError if a weight file is missing or truncated (cheap: headers only)."""

    def require(self, names: Iterable[str]) -> None:
        """Raise WorkerError (one line) if the weights of these parameters (model.py names: a
        stage's) are not all at hand: an HF folder fetched for one stage holds only that stage's
        files (hf_source). By default nothing more than `check` did."""


def pad_rows(t: torch.Tensor, shard: Shard | None, full: int) -> torch.Tensor:
    """Zero rows past the real vocabulary for a padded (vocab-parallel) shard."""
    if shard is None or not shard.padded:
        return t
    start, stop = shard.bounds(full)
    if t.shape[0] < stop - start:
        t = torch.cat([t, t.new_zeros((stop - start - t.shape[0],) + tuple(t.shape[1:]))])
    return t
