"""API keys: the bearer tokens a server started with --api-key-file accepts on /v1/*.

The file holds one key per line (blank lines are skipped). A request to /v1/* without
`Authorization: Bearer <one of them>` gets OpenAI's 401 (code invalid_api_key); /healthz and
/metrics stay open for probes and scrapers. A token is compared with every key in constant time
(hmac.compare_digest, and no early exit), so the time an answer takes tells nothing of how much
of a key a guess got right. Keys are never written to a log or an error message.
"""
from __future__ import annotations

import hmac

from shardwise.worker.errors import WorkerError

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
           "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


class ApiKeys:
    """The accepted keys."""

    def __init__(self, keys: list[str]):
        if not keys:
            raise WorkerError("an API key file must hold at least one key")
        self.keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """The keys of `path`, or a WorkerError naming the file (never its content)."""
        try:
            with open(path, encoding="utf-8") as f:
                keys = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise WorkerError(f"cannot read the API key file {path}: {getattr(e, 'strerror', None) or e}") from None
        if not keys:
            raise WorkerError(f"the API key file {path} holds no key (one per line)")
        return cls(keys)

    def refusal(self, authorization: str | None) -> str | None:
        """Why a request with this Authorization header is refused (MISSING, INCORRECT), or None."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING
        given = token.strip().encode("utf-8", "surrogateescape")
        accepted = False
        for key in self.keys:           # every key, whatever matched: constant in the keys' count
            accepted |= hmac.compare_digest(key, given)
        return None if accepted else INCORRECT
