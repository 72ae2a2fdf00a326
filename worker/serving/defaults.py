"""The serving defaults the engine's modules read, torch-free so that the commands' `--help` states
them without importing torch. Each has one definition: those the plan sizes in crds/capacity.py,
which the planner and the pod contract read too (this module names them for the worker), and the
worker's own here."""

from shardwise.crds.capacity import (DEFAULT_CONTEXT, KV_BLOCK_SIZE, MAX_BATCH, MIN_WAITING, PREFILL_CHUNK,
                                     WAITING_PER_ROW, DecodeMode, max_waiting)

# Tokens per step (scheduler.py): every running request's decode token, then prompt chunks of as
# many prefilling requests as fit. A worker setting (serve/generate/worker --max-step-tokens), not
# one the plan sizes: it trades the running streams' inter-token latency for prefill throughput.
# 256 on a CPU: a step's time grows with its prompt tokens there, and 16 decodes beside 240 prompt
# tokens take about half the time they take beside 496 (docs/worker.md, the token-budget scheduler).
MAX_STEP_TOKENS = 256

__all__ = ["DEFAULT_CONTEXT", "KV_BLOCK_SIZE", "MAX_BATCH", "MAX_STEP_TOKENS", "MIN_WAITING", "PREFILL_CHUNK",
           "WAITING_PER_ROW", "DecodeMode", "max_waiting"]
