"""What a serving replica takes on at once: the defaults (one definition each), the rule the planner
derives the number of concurrent sequences by, and the spec fields that override them.

Torch-free and in crds/ because three sides read the same numbers: the planner (which sizes the KV
cache and derives the concurrency from it), the pod contract (which carries every setting to the
pods, resolved), and the worker (whose `serve`, `generate` and `worker` flags default to them, and
whose engine runs with them). worker/serving/defaults.py re-exports them for the engine's modules.

A sequence is one choice of one request (a request of n choices is n sequences).
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import ConfigDict, Field, model_validator

from shardwise.crds.apimodel import ApiModel, cel

# ---- defaults
MAX_BATCH = 8                 # sequences decoded together where no plan sized them (serve, generate)
KV_BLOCK_SIZE = 16            # tokens per KV-cache block (vLLM's default)
PREFILL_CHUNK = 512           # prompt tokens per prefill step
KV_CACHE_TOKENS = 8192        # spec.serving.kvCacheTokens: tokens of KV cache per replica
DEFAULT_CONTEXT = 4096        # context per sequence when none is asked: the model's own, at most this

# ---- the concurrency the planner derives from the KV budget it sized (derived_sequences)
# The tokens a sequence is assumed to hold in the paged cache: prompt and answer together. vLLM logs
# the concurrency its cache admits at the full context (a worst case no workload has; it then runs
# max_num_seqs = 256 whatever the cache); SGLang sizes its request pool at a few tokens a request and
# retracts when the cache fills. Both then preempt when the cache runs out, as this engine does
# (the newest request first, resumed later from its tokens so far), so the assumption sets how
# often that happens, not whether requests succeed. 512 tokens: a chat turn or a short completion
# with its prompt (load benchmarks draw prompts of tens to hundreds of tokens and answers of 64 to
# a few hundred).
TYPICAL_SEQUENCE_TOKENS = 512
MAX_DERIVED_SEQUENCES = 256   # derived at most (vLLM's max_num_seqs): more rows than this gain little
MAX_SEQUENCES = 4096          # spec.serving.maxConcurrentRequests at most

# ---- the waiting queue: sequences queued for a place, bounded so that a flood is refused at once
# (HTTP 429 with Retry-After) rather than kept in memory to run hours later; by default this many
# per running sequence, and at least MIN_WAITING so that a burst of a few hundred requests to a
# small replica queues instead of being refused.
WAITING_PER_ROW = 4
MIN_WAITING = 128
MAX_WAITING = 16384           # spec.serving.maxWaiting at most (each waiting request holds a thread)

MAX_MODEL_LENGTH = 1 << 20    # spec.serving.maxModelLength at most
MAX_KV_CACHE_TOKENS = 1 << 24  # spec.serving.kvCacheTokens at most
MAX_KV_BLOCK_SIZE = 1024
MAX_PREFILL_CHUNK = 65536

CONTEXT_OVER_CACHE = ("serving.maxModelLength must not exceed serving.kvCacheTokens: one sequence of the "
                      "whole context must fit the cache (kvCacheTokens 0: a whole context per sequence)")


def max_waiting(max_sequences: int) -> int:
    """The default bound of the waiting queue, in sequences, of a replica running `max_sequences`."""
    return max(MIN_WAITING, WAITING_PER_ROW * max_sequences)


def typical_tokens(max_model_length: int | None = None) -> int:
    """The tokens a sequence is assumed to hold: TYPICAL_SEQUENCE_TOKENS, or the whole context when
    that is shorter."""
    return min(TYPICAL_SEQUENCE_TOKENS, max_model_length or TYPICAL_SEQUENCE_TOKENS)


def derived_sequences(kv_cache_tokens: int, max_model_length: int | None = None) -> int:
    """The sequences a replica runs at once when the spec does not say: its KV cache over the tokens
    a sequence typically holds, at least 1 and at most MAX_DERIVED_SEQUENCES. A cache of 0 tokens
    (a whole context per sequence, sized by the concurrency instead): MAX_BATCH."""
    if kv_cache_tokens <= 0:
        return MAX_BATCH
    return max(1, min(MAX_DERIVED_SEQUENCES, kv_cache_tokens // typical_tokens(max_model_length)))


class DecodeMode(str, Enum):
    """How a worker runs its decode steps (worker/serving/pipeline.py decode_mode)."""

    AUTO = "auto"          # graphs on CUDA, eager on CPU
    EAGER = "eager"
    GRAPHS = "graphs"      # CUDA graphs (CUDA only)
    COMPILE = "compile"    # torch.compile, replayed as CUDA graphs on CUDA


class ServingCapacity(ApiModel):
    """The part of spec.serving that says how much a replica takes on at once (the base of
    crds/models.py Serving). Omitted fields take the defaults above; the pod contract carries
    each resolved (crds/contract.py)."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.maxModelLength) || !has(self.kvCacheTokens) || self.kvCacheTokens == 0 || "
         "self.maxModelLength <= self.kvCacheTokens", CONTEXT_OVER_CACHE, ".maxModelLength"),
    ))

    kv_cache_tokens: int = Field(KV_CACHE_TOKENS, ge=0, le=MAX_KV_CACHE_TOKENS, description=(
        "Tokens of KV cache per replica: the planner reserves memory for them and the workers' "
        "paged cache holds that many, shared in blocks by the requests running (0: a whole "
        "context per request)."))
    max_concurrent_requests: Optional[int] = Field(None, ge=1, le=MAX_SEQUENCES, description=(
        f"Sequences a replica decodes at once (a request of n choices is n). Omitted: the planner "
        f"derives it from kvCacheTokens, kvCacheTokens / {TYPICAL_SEQUENCE_TOKENS} (or / maxModelLength "
        f"when shorter), between 1 and {MAX_DERIVED_SEQUENCES}; {MAX_BATCH} when kvCacheTokens is 0."))
    max_model_length: Optional[int] = Field(None, ge=2, le=MAX_MODEL_LENGTH, description=(
        f"Context per sequence in tokens, prompt and completion together (/v1/models reports it as "
        f"max_model_len); at most the model's own. Omitted: the model's own, at most {DEFAULT_CONTEXT}. "
        f"Must not exceed kvCacheTokens (unless 0)."))
    max_waiting: Optional[int] = Field(None, ge=1, le=MAX_WAITING, description=(
        f"Sequences queued for a place at most; a request beyond is refused at once with HTTP 429 "
        f"and Retry-After. Omitted: {WAITING_PER_ROW} x maxConcurrentRequests, at least {MIN_WAITING}."))
    kv_block_size: Optional[int] = Field(None, ge=1, le=MAX_KV_BLOCK_SIZE, description=(
        f"Tokens per KV-cache block: a sequence takes blocks as it grows, and sequences share the "
        f"blocks of a common prompt prefix. Omitted: {KV_BLOCK_SIZE}."))
    prefill_chunk: Optional[int] = Field(None, ge=1, le=MAX_PREFILL_CHUNK, description=(
        f"Prompt tokens per prefill step; the running sequences decode between a long prompt's "
        f"chunks. Omitted: {PREFILL_CHUNK}."))
    decode: DecodeMode = Field(DecodeMode.AUTO, description=(
        "How decode steps run: eager; graphs (CUDA graphs, CUDA only); compile (torch.compile); "
        "auto: graphs on CUDA, eager on CPU."))

    @model_validator(mode="after")
    def _context_fits_the_cache(self) -> "ServingCapacity":
        if self.max_model_length and self.kv_cache_tokens and self.max_model_length > self.kv_cache_tokens:
            raise ValueError(f"{CONTEXT_OVER_CACHE} (maxModelLength {self.max_model_length}, "
                             f"kvCacheTokens {self.kv_cache_tokens})")
        return self

    def planned_sequences(self) -> int:
        """The sequences a replica runs at once: maxConcurrentRequests, else derived_sequences."""
        return self.max_concurrent_requests or derived_sequences(self.kv_cache_tokens, self.max_model_length)

    def resolved(self, planned: int = 0) -> dict:
        """Every setting with its default applied, as field -> value (what a pod contract carries);
        `planned`: the plan's concurrency (ShardPlan.max_sequences; 0 for a plan made before it)."""
        sequences = self.max_concurrent_requests or planned or self.planned_sequences()
        return {"kv_cache_tokens": self.kv_cache_tokens, "max_concurrent_requests": sequences,
                "max_model_length": self.max_model_length,
                "max_waiting": self.max_waiting or max_waiting(sequences),
                "kv_block_size": self.kv_block_size or KV_BLOCK_SIZE,
                "prefill_chunk": self.prefill_chunk or PREFILL_CHUNK, "decode": self.decode}
