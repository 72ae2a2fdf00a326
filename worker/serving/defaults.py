"""The serving defaults, torch-free so that the commands' `--help` states them without importing
torch: one definition each, used by the scheduler, RankSpec and the flags."""

MAX_BATCH = 8                 # requests decoded together (engine rows)
KV_BLOCK_SIZE = 16            # tokens per KV-cache block (vLLM's default)
PREFILL_CHUNK = 512           # prompt tokens of one request per step
# Tokens per step (scheduler.py): every running request's decode token, then prompt chunks of as
# many prefilling requests as fit. The same as one whole chunk, so that a step that prefills stays
# as long as a prefill step was, however many prompts share it.
MAX_STEP_TOKENS = 512
# The queue of sequences waiting for a row (a request of n choices is n of them), bounded so that
# a flood of requests is refused at once (HTTP 429) rather than kept in memory to run hours later:
# by default this many per row, and at least one request of the most choices (serve --max-waiting)
WAITING_PER_ROW = 4
MIN_WAITING = 16


def max_waiting(max_batch: int) -> int:
    """The default bound of the waiting queue, in sequences, of an engine of `max_batch` rows."""
    return max(MIN_WAITING, WAITING_PER_ROW * max_batch)
