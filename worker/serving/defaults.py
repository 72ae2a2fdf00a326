"""The serving defaults the engine's modules read, torch-free so that the commands' `--help` states
them without importing torch. Each has one definition, in crds/capacity.py, which the planner and
the pod contract read too; this module names them for the worker."""

from shardwise.crds.capacity import (DEFAULT_CONTEXT, KV_BLOCK_SIZE, MAX_BATCH, MIN_WAITING, PREFILL_CHUNK,
                                     WAITING_PER_ROW, DecodeMode, max_waiting)

__all__ = ["DEFAULT_CONTEXT", "KV_BLOCK_SIZE", "MAX_BATCH", "MIN_WAITING", "PREFILL_CHUNK", "WAITING_PER_ROW",
           "DecodeMode", "max_waiting"]
