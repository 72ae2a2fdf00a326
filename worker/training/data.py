"""Training data: a text file, tokenized once, cut into fixed-length windows, read in an order keyed
by (seed, step) alone.

Why keyed by step: the batch of step `s` must be the same whatever the layout (tensor/pipeline/
data-parallel degrees) and whether the run was interrupted, so that a resumed run reproduces the
uninterrupted one. So the position in the data is not a cursor that has to be saved and restored
per rank: it is a pure function of the step. The whole global batch of step `s` is
`window_ids(s)`; data-parallel replica `r` of `D` takes rows [r*B/D, (r+1)*B/D) of it.

Order: the windows are visited epoch by epoch, each epoch in its own permutation (seeded by seed
and epoch), so every window is seen once per epoch without replacement.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class DataError(Exception):
    """A dataset or tokenizer that cannot be used: one line naming the file and what is wrong."""


@dataclass
class TokenDataset:
    tokens: torch.Tensor          # int64 [N], the whole file's token ids
    path: str
    fingerprint: str              # sha256 of the file's bytes (first 16 hex digits)

    @classmethod
    def from_file(cls, path: str | Path, encode: Callable[[str], list[int]]) -> "TokenDataset":
        """Read and tokenize a UTF-8 text file; `encode` is the model tokenizer's text -> ids."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except IsADirectoryError:
            raise DataError(f"dataset {path} is a directory, not a text file") from None
        except OSError as e:
            raise DataError(f"dataset {path} cannot be read: {e.strerror or e}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"dataset {path} is not UTF-8 text (byte {e.start})") from None
        if not text.strip():
            raise DataError(f"dataset {path} is empty")
        ids = encode(text)
        return cls(torch.tensor(ids, dtype=torch.long), str(path),
                   hashlib.sha256(raw).hexdigest()[:16])

    def __len__(self) -> int:
        return int(self.tokens.numel())


class StepBatches:
    """The global batch of any step: `batch_size` windows of `seq_len + 1` tokens (inputs+targets)."""

    def __init__(self, data: TokenDataset, seq_len: int, batch_size: int, seed: int):
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed
        self.num_windows = (len(data) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"dataset {data.path} has {len(data)} tokens: fewer than one sequence of "
                            f"--seq-len {seq_len} plus one; use a shorter --seq-len or more text")
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.num_windows, generator=g))
        return self._perm[1]

    def window_ids(self, step: int) -> list[int]:
        """The windows of step `step` (steps count from 1): a pure function of (seed, step)."""
        out = []
        for i in range((step - 1) * self.batch_size, step * self.batch_size):
            epoch, pos = divmod(i, self.num_windows)
            out.append(int(self._order(epoch)[pos]))
        return out

    def batch(self, step: int, replica: int = 0, replicas: int = 1) -> torch.Tensor:
        """int64 [batch_size / replicas, seq_len + 1]: this replica's rows of step `step`'s batch."""
        if self.batch_size % replicas:
            raise DataError(f"--batch-size {self.batch_size} is not divisible by {replicas} data-parallel replicas")
        per = self.batch_size // replicas
        ids = self.window_ids(step)[replica * per:(replica + 1) * per]
        return torch.stack([self.data.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1] for w in ids])

    def epoch_of(self, step: int) -> float:
        return (step * self.batch_size) / self.num_windows

    def position(self, step: int) -> dict:
        """What a checkpoint records as the data position after `step` steps."""
        return {"step": step, "windows_seen": step * self.batch_size, "epoch": round(self.epoch_of(step), 4),
                "dataset": self.data.path, "fingerprint": self.data.fingerprint,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "seed": self.seed}


def _mix(seed: int, n: int) -> int:
    """A 63-bit generator seed from (seed, n), so nearby seeds/epochs give unrelated streams."""
    h = hashlib.blake2b(f"{seed}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)
