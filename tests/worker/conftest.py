"""What every worker test shares: the texts tiny models are trained on, the writer of the tiny random
model (shardwise.worker.weights.tiny) and the one tiny model most serving tests serve.

Fixtures (all session-scoped):
  corpus              300 lines of 12 words from a small vocabulary, the same every time: the
                      training data, and the text a tiny model's tokenizer learns by default
  pangrams            the two pangrams the serving tests' prompts are drawn from, repeated
  tiny_model          writes a tiny model (write_tiny_model's shape arguments) with its tokenizer
                      trained on `text` (the corpus unless given): tiny_model(path, layers=2, tie=True),
                      tiny_model(path, pangrams, layers=3)
  tiny_serving_model  one model per session, 2 layers of 64 wide with 4 heads and 2 KV heads, its
                      tokenizer trained on the pangrams: the tests only read it; one that changes its
                      model folder, or needs another shape, writes its own with tiny_model
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardwise.worker.weights.tiny import write_tiny_model
from tests.worker.texts import PANGRAMS


@pytest.fixture(scope="session")
def corpus() -> str:
    rnd = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew potent "
             "elixirs under the pale moon").split()
    return "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300))


@pytest.fixture(scope="session")
def pangrams() -> str:
    return PANGRAMS


@pytest.fixture(scope="session")
def tiny_model(corpus):
    def write(path: Path, text: str | None = None, **shape) -> Path:
        return write_tiny_model(path, corpus if text is None else text, **shape)
    return write


@pytest.fixture(scope="session")
def tiny_serving_model(tmp_path_factory, tiny_model, pangrams) -> Path:
    return tiny_model(tmp_path_factory.mktemp("serving") / "tiny", pangrams, layers=2, hidden=64, heads=4,
                      kv_heads=2)


@pytest.fixture(scope="session")
def tiny_3_layers(tmp_path_factory, tiny_model) -> str:
    """A 3-layer tiny model (hidden 64, 4 heads, 2 KV heads), for the engine's tests on real ranks."""
    return str(tiny_model(tmp_path_factory.mktemp("tiny3"), layers=3))
