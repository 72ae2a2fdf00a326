"""The texts tiny models' tokenizers are trained on, for worker tests and for end-to-end tests that
serve a tiny model (tests/e2e), which cannot use tests/worker's fixtures; and seeded random prompts
of token ids for the engine's tests."""
from __future__ import annotations


# the two pangrams the serving tests' prompts are drawn from, repeated
PANGRAMS = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. " * 20


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 2-59 token ids in 3..249 (inside a tiny model's 300-token vocabulary), the
    same for the same seed."""
    import torch    # here, not at the top: end-to-end tests import this module for its texts only
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 60, (n,), generator=g).tolist()
    return [torch.randint(3, 250, (k,), generator=g).tolist() for k in lengths]
