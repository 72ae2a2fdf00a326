"""The router's tests share the worker tests' tiny serving model (real `shardwise serve` replicas)."""
from tests.worker.conftest import corpus, pangrams, tiny_model, tiny_serving_model  # noqa: F401 - fixtures
