"""OpenAI's error shape, the one every error response of the HTTP API has:
{"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import sys
import uuid


class BadRequest(Exception):
    """A request the server answers with an error status (4xx, or 503 while loading or draining)
    instead of a completion; `param` names the offending parameter, `code` is OpenAI's code,
    `retry_after` the seconds of a Retry-After header (a 429)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after


def error_object(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The {"error": ...} object; `type` follows the status (server_error from 500 on)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_object(message, status, param, code)).encode()


def internal_error(where: str, e: BaseException) -> str:
    """The message of a 500: a fixed sentence and a request id, naming nothing of the server's
    insides; the exception goes to the server's log under the same id."""
    rid = "req-" + uuid.uuid4().hex[:16]
    print(f"shardwise serve: {where}: {rid}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return f"internal server error (request id {rid}); the server's log has the details"
