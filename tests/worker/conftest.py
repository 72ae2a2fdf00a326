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
  s3_server           a real S3 server (MinIO, shardwise.e2e.s3server) on a loopback port, a
                      temporary data folder, random credentials; skipped when the binary is not
                      built (`shardwise dev build-s3`) unless SHARDWISE_REQUIRE_CLUSTER is set
  s3_config           the worker's S3Config for it (path style, short timeouts)
  s3_client           a boto3 client signed with the server's credentials (uploads, rewrites)
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from shardwise.e2e import s3server
from shardwise.worker.fetch.s3 import S3Config, make_client
from shardwise.worker.training.s3_storage import prepare_client
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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    if not os.access(s3server.minio_path(), os.X_OK) and not os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
        pytest.skip("the S3 server is not built: shardwise dev build-s3")
    with s3server.running_s3_server(tmp_path_factory.mktemp("minio")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_config(s3_server) -> S3Config:
    return S3Config(endpoint=s3_server.endpoint, region=s3_server.region, path_style=True,
                    read_timeout_s=10, attempts=2)


@pytest.fixture(scope="session")
def s3_client(s3_server, s3_config):
    # (prepare_client: an empty PUT without 'Expect: 100-continue', which MinIO leaves unanswered)
    return prepare_client(make_client(s3_config, s3_server.env()))
