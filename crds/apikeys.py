"""API keys: the one key-file format and check that a served model's pods and its router share.

The file holds one key per line (blank lines are skipped). A request without
`Authorization: Bearer <one of them>` gets OpenAI's 401 (code invalid_api_key) with one of the
texts below. A token is compared with every key in constant time (hmac.compare_digest, and no early
exit), so the time an answer takes tells nothing of how much of a key a guess got right. Keys are
never written to a log or an error message.
"""
from __future__ import annotations

import hmac

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
           "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file, never its content."""


class ApiKeys:
    """The accepted keys. `error` is the exception type a bad key file raises (a part of the
    product that has its own user-facing error type sets it in a subclass)."""

    error: type[Exception] = KeyFileError

    def __init__(self, keys: list[str]):
        if not keys:
            raise self.error("an API key file must hold at least one key")
        self.keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """The keys of `path`, or `error` naming the file (never its content)."""
        try:
            with open(path, encoding="utf-8") as f:
                keys = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise cls.error(f"cannot read the API key file {path}: {getattr(e, 'strerror', None) or e}") from None
        if not keys:
            raise cls.error(f"the API key file {path} holds no key (one per line)")
        return cls(keys)

    def identify(self, authorization: str | None) -> tuple[str | None, int]:
        """(why a request with this Authorization header is refused: MISSING, INCORRECT or None,
        the index of the key it carries or -1). The index lets a caller keep per-key state (rate
        limits) without holding the key."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return MISSING, -1
        given = token.strip().encode("utf-8", "surrogateescape")
        found = -1
        for i, key in enumerate(self.keys):     # every key, whatever matched: constant in the keys' count
            if hmac.compare_digest(key, given):
                found = i
        return (None, found) if found >= 0 else (INCORRECT, -1)

    def refusal(self, authorization: str | None) -> str | None:
        """Why a request with this Authorization header is refused (MISSING, INCORRECT), or None."""
        return self.identify(authorization)[0]
