"""API keys: the bearer tokens a server started with --api-key-file accepts on /v1/*.

The file format, the constant-time check and OpenAI's error texts are shardwise.crds.apikeys, which
the model's router reads too; here a bad key file is a WorkerError. A request to /v1/* without a
key it holds gets OpenAI's 401 (code invalid_api_key); /healthz and /metrics stay open for probes
and scrapers. Keys are never written to a log or an error message.
"""
from __future__ import annotations

from shardwise.crds import apikeys
from shardwise.crds.apikeys import INCORRECT, MISSING
from shardwise.worker.errors import WorkerError

__all__ = ["ApiKeys", "INCORRECT", "MISSING"]


class ApiKeys(apikeys.ApiKeys):
    """The accepted keys; a bad key file is a WorkerError (one line, naming the file)."""

    error = WorkerError
