"""spec.serving.speculative: speculative decoding by prompt lookup (the worker's
worker/serving/speculative.py), its bounds and defaults; importable from crds/models.py too."""
from __future__ import annotations

from enum import Enum

from pydantic import ConfigDict, Field, model_validator

from shardwise.crds.apimodel import ApiModel, cel

# Speculative decoding's bounds and defaults (worker/serving/speculative.py): draft tokens per row
# and step, and the lengths of the n-grams looked up in the sequence, longest first (one-token
# matches are left out by default: on CPU a rejected draft costs more than a one-token match wins).
DRAFT_TOKENS, DRAFT_TOKENS_MAX = 4, 16
NGRAM_MIN, NGRAM_MAX, NGRAM_LIMIT = 2, 3, 8


class SpeculativeMethod(str, Enum):
    NONE = "none"      # one token per row and step
    NGRAM = "ngram"    # prompt lookup: drafts copied from where the sequence's last tokens occurred before


class Speculative(ApiModel):
    """Speculative decoding: greedy requests take several tokens a step when their text repeats what
    came before (sampled ones decode as without it)."""

    model_config = ConfigDict(json_schema_extra=cel(
        # has(): the API server checks the rule against the field's default ({}) too
        ("!has(self.ngramMin) || !has(self.ngramMax) || self.ngramMin <= self.ngramMax",
         "serving.speculative: ngramMin must not exceed ngramMax")))

    method: SpeculativeMethod = Field(SpeculativeMethod.NONE, description=(
        "none: off; ngram: prompt lookup, drafts copied from where the sequence's last n tokens "
        "occurred earlier in its prompt or output, verified in one step (no second model)."))
    draft_tokens: int = Field(DRAFT_TOKENS, ge=1, le=DRAFT_TOKENS_MAX, description=(
        "Drafts per request and step: the most tokens a step can add beyond its one."))
    ngram_max: int = Field(NGRAM_MAX, ge=1, le=NGRAM_LIMIT, description="Longest n-gram looked up.")
    ngram_min: int = Field(NGRAM_MIN, ge=1, le=NGRAM_LIMIT, description="Shortest n-gram looked up.")

    @model_validator(mode="after")
    def _ngram_range(self) -> "Speculative":
        if self.ngram_min > self.ngram_max:
            raise ValueError("serving.speculative: ngramMin must not exceed ngramMax")
        return self
