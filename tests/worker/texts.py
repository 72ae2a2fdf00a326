"""The texts tiny models' tokenizers are trained on, for worker tests and for end-to-end tests that
serve a tiny model (tests/e2e), which cannot use tests/worker's fixtures."""
from __future__ import annotations

# the two pangrams the serving tests' prompts are drawn from, repeated
PANGRAMS = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. " * 20
