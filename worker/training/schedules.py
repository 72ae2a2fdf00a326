"""Pipeline stages of a training job and their schedule, on torch.distributed.pipelining.

A pipeline rank p of P holds one stage (GPipe, 1F1B) or, for interleaved 1F1B, V = 2 "virtual"
stages p and p + P of a model cut into P·V stages: each rank's idle time (the bubble) shrinks by V,
at the price of more point-to-point messages. PyTorch's schedules run the micro-batches:

    GPipe             all forwards, then all backwards: activations of every micro-batch alive
    1F1B              after P warm-up forwards, one forward then one backward: at most P alive
    Interleaved1F1B   1F1B over the virtual stages

Bubble fraction of a step (P stages, m micro-batches, V virtual stages per rank):
(P - 1) / (V·m + P - 1); the default m = 2·P (where the batch splits so) keeps it under a third.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from shardwise.crds import schedules as schedule_rules

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
DEFAULT_SCHEDULE = schedule_rules.DEFAULT_SCHEDULE.value
# The rules (stages per rank, the micro-batch multiple, the default micro-batches) are the API's.
virtual_stages = schedule_rules.virtual_stages
default_micro_batches = schedule_rules.default_micro_batches


def stage_indices(pp_rank: int, pipeline: int, schedule: str) -> list[int]:
    """Which of the P·V stages pipeline rank `pp_rank` holds (round robin: p, p + P, ...)."""
    return [pp_rank + v * pipeline for v in range(virtual_stages(schedule))]


def bubble_fraction(pipeline: int, micro_batches: int, schedule: str) -> float:
    """The formula's idle fraction of a pipeline rank over one step."""
    v = virtual_stages(schedule)
    return (pipeline - 1) / (v * micro_batches + pipeline - 1)


def check_schedule(schedule: str, pipeline: int, micro_batches: int, layers: int) -> str | None:
    """Why this schedule cannot run (one line naming the option), or None."""
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}"
    return schedule_rules.schedule_problem(schedule, pipeline, micro_batches, layers)


def build_schedule(modules: list[nn.Module], indices: list[int], pipeline: int, schedule: str,
                   micro_batches: int, device: torch.device, group,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The schedule object whose `step(...)` runs one training step on this rank's stages."""
    n = pipeline * virtual_stages(schedule)
    stages = [PipelineStage(m, i, n, device, group=group) for m, i in zip(modules, indices)]
    cls = SCHEDULES[schedule]
    if cls is ScheduleInterleaved1F1B:
        return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
