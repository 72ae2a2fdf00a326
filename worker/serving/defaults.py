"""The serving defaults, torch-free so that the commands' `--help` states them without importing
torch: one definition each, used by the scheduler, RankSpec and the flags."""

MAX_BATCH = 8                 # requests decoded together (engine rows)
KV_BLOCK_SIZE = 16            # tokens per KV-cache block (vLLM's default)
PREFILL_CHUNK = 512           # prompt tokens per prefill step
