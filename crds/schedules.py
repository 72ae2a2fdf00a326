"""The rules of a training job's pipeline schedule, torch-free: the API validates them, the planner
plans by them and the worker (worker/training/schedules.py) runs by them.

A pipeline rank of P holds one stage (GPipe, 1F1B) or, for interleaved 1F1B, 2 "virtual" stages of
a model cut into 2·P; interleaved 1F1B also needs its micro-batches to be a multiple of P. A replica
runs 2·P micro-batches where its batch splits so (the bubble stays under a third).
"""
from __future__ import annotations

from enum import Enum


class PipelineSchedule(str, Enum):
    """How a replica's pipeline stages interleave micro-batches (torch.distributed.pipelining)."""

    ONE_F_ONE_B = "1F1B"                   # one forward, one backward: few activations in flight
    GPIPE = "GPipe"                        # all forwards, then all backwards
    INTERLEAVED_1F1B = "Interleaved1F1B"   # 1F1B over several virtual stages per rank: a smaller bubble


DEFAULT_SCHEDULE = PipelineSchedule.ONE_F_ONE_B
INTERLEAVED_VIRTUAL_STAGES = 2   # stages each pipeline rank holds under Interleaved1F1B

# The API's words for a spec that breaks the micro-batch rule (a CEL rule and its Python twin).
INTERLEAVED_MICRO_BATCHES = ("training.microBatches must be a multiple of parallelism.pipeline for "
                             "schedule Interleaved1F1B")


def virtual_stages(schedule: str) -> int:
    """Stages each pipeline rank holds."""
    return INTERLEAVED_VIRTUAL_STAGES if schedule == PipelineSchedule.INTERLEAVED_1F1B else 1


def micro_batches_fit(schedule: str, pipeline: int | None, micro_batches: int | None) -> bool:
    """Interleaved1F1B runs a multiple of the pipeline degree as micro-batches; any other schedule,
    an unset count or degree, or one pipeline stage takes any count."""
    if schedule != PipelineSchedule.INTERLEAVED_1F1B or not micro_batches or not pipeline:
        return True
    return micro_batches % pipeline == 0


def schedule_problem(schedule: str, pipeline: int, micro_batches: int, layers: int) -> str | None:
    """Why a known schedule cannot run this pipeline (one line naming the option), or None."""
    stages = pipeline * virtual_stages(schedule)
    if stages > layers:
        return (f"{PipelineSchedule(schedule).value} with {pipeline} pipeline ranks needs {stages} stages, more than the "
                f"model's {layers} layers")
    if not micro_batches_fit(schedule, pipeline, micro_batches):
        return (f"Interleaved1F1B needs micro-batches ({micro_batches}) to be a multiple of the "
                f"pipeline degree {pipeline}")
    return None


def default_micro_batches(pipeline: int, per_replica_batch: int, schedule: str = DEFAULT_SCHEDULE) -> int:
    """Two micro-batches per stage where the replica's batch splits so: the largest divisor of the
    batch up to 2·P (for interleaved 1F1B, the largest such multiple of P, if any)."""
    if pipeline == 1:
        return 1
    fits = [m for m in range(1, min(2 * pipeline, per_replica_batch) + 1) if per_replica_batch % m == 0]
    if schedule == PipelineSchedule.INTERLEAVED_1F1B:
        fits = [m for m in fits if micro_batches_fit(schedule, pipeline, m)] or fits
    return max(fits)
