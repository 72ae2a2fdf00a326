"""Runs the steps the scheduler decides on the pipeline's stages: the one part of the engine that
touches tensors and torch.distributed (through pipeline.Stage).

A step is a ragged batch: row r feeds Step.counts[r] tokens from its position Step.starts[r] and
asks for the logits of its last Step.logits[r] positions. It becomes the tokens and positions of
all rows, row by row ([N]), and the block tables [rows, blocks], launched on stage 0 (pipeline.py
sends it on); `collect` returns the oldest launched step with the logits it asked for. Several
steps are in flight at once, one per micro-batch.
"""
from __future__ import annotations

from collections import deque

import torch

from shardwise.worker.serving.pipeline import OP_SETUP, OP_STEP
from shardwise.worker.serving.scheduler import Step


class Runner:
    """Rank 0's side of the stages: sets up their caches, then launches and collects steps."""

    def __init__(self, stage, cache_blocks: int, max_seq: int, block_size: int):
        self.stage = stage
        self.inflight: deque[Step] = deque()        # launched, logits not collected yet; oldest first
        stage.launch(OP_SETUP, cache_blocks=cache_blocks, seq=max_seq, block_size=block_size)

    def launch(self, step: Step) -> None:
        tokens = [t for row in step.tokens for t in row]
        positions = [p for start, row in zip(step.starts, step.tokens) for p in range(start, start + len(row))]
        self.stage.launch(OP_STEP, torch.tensor(tokens), torch.tensor(positions), torch.tensor(step.tables),
                          counts=step.counts, logits=step.logits)
        self.inflight.append(step)

    def collect(self) -> tuple[Step, torch.Tensor]:
        """The oldest step in flight and the logits it asked for: [sum(step.logits), vocabulary]
        (float32, on the device the last stage made or sent them on), row by row, row r's last
        step.logits[r] positions in order; Step.next_logits indexes what gives each ready row its
        next token when no draft is verified.
        A row that fed a draft of k tokens has 1 + k of them: position j's logits give the token
        after its j-th fed token (j = 0: after the decode token), to check the draft against."""
        return self.inflight.popleft(), self.stage.collect()
