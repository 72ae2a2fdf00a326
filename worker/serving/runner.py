"""Runs the steps the scheduler decides on the pipeline's stages: the one part of the engine that
touches tensors and torch.distributed (through pipeline.Stage).

A step becomes three tensors, tokens and positions [rows, tokens per row] and block tables
[rows, blocks], launched on stage 0 (pipeline.py sends it on); `collect` returns the oldest launched
step with its last-position logits. Several steps are in flight at once, one per micro-batch.
"""
from __future__ import annotations

from collections import deque

import torch

from shardwise.worker.serving.pipeline import OP_SETUP, OP_STEP, OP_VERIFY
from shardwise.worker.serving.scheduler import Step


class Runner:
    """Rank 0's side of the stages: sets up their caches, then launches and collects steps."""

    def __init__(self, stage, cache_blocks: int, max_seq: int, block_size: int):
        self.stage = stage
        self.inflight: deque[Step] = deque()        # launched, logits not collected yet; oldest first
        stage.launch(OP_SETUP, cache_blocks=cache_blocks, seq=max_seq, block_size=block_size)

    def launch(self, step: Step) -> None:
        op = OP_STEP
        if step.drafts is not None:      # each row's token and drafts; logits at every position
            op, positions = OP_VERIFY, torch.tensor(step.starts)[:, None] + torch.arange(step.fed)
        elif step.prefill:
            start = step.starts[0]
            positions = torch.arange(start, start + step.fed)[None]
        else:
            positions = torch.tensor([[p] for p in step.starts])
        self.stage.launch(op, torch.tensor(step.tokens), positions, torch.tensor(step.tables))
        self.inflight.append(step)

    def collect(self) -> tuple[Step, torch.Tensor]:
        """The oldest step in flight and its logits [rows, vocabulary] ([rows, tokens, vocabulary]
        for a verification step; float32, on the device the last stage made or sent them on)."""
        return self.inflight.popleft(), self.stage.collect()
