"""A request's body read off the connection within bounds: its declared length checked before a
byte of it is read (the same rules on every path and method, known or not), and its JSON parsed
no deeper than a fixed nesting.

A client on the pod network is not trusted to frame its request sensibly: a negative or
non-numeric Content-Length, a body of gigabytes, chunked transfer encoding (whose length is not
known up front), or JSON nested thousands of levels deep each get a one-line 4xx in OpenAI's
error shape, and the connection is closed whenever the body was not read (what follows on it
could not be told apart from the next request).
"""
from __future__ import annotations

import json

from shardwise.crds import boundedjson
from shardwise.worker.serving.http.errors import BadRequest

MAX_BODY = 4 << 20              # bytes of a request body
MAX_JSON_DEPTH = 64             # nested arrays and objects in a body (a chat request needs 5)
MISSING_LENGTH = "a JSON body with Content-Length is required"


def body_length(headers, method: str) -> int:
    """The body's length as its headers declare it, or BadRequest: 411 for a POST without
    Content-Length or with Transfer-Encoding, 400 for a length that is not a non-negative
    integer (or several that disagree), 413 over MAX_BODY. Other methods may leave it out (0)."""
    if headers.get("Transfer-Encoding") is not None:
        raise BadRequest("Transfer-Encoding is not supported; send the body with a Content-Length", 411)
    values = {v.strip() for v in headers.get_all("Content-Length") or []}
    if not values:
        if method == "POST":
            raise BadRequest(MISSING_LENGTH, 411)
        return 0
    if len(values) > 1:
        raise BadRequest("Content-Length is given more than once, with different values")
    value = values.pop()
    # digits only: int() would also take "-5", "+5", " 5", "5_000" and non-ASCII digits
    if not (value.isascii() and value.isdigit()):
        raise BadRequest("Content-Length must be a non-negative integer")
    n = int(value)
    if n > MAX_BODY:
        raise BadRequest(f"body of {n} bytes is larger than {MAX_BODY}", 413)
    return n


def parse_json(raw: bytes):
    """The body's JSON, or BadRequest (400) saying why it is not acceptable JSON."""
    try:
        body = boundedjson.loads(raw, MAX_JSON_DEPTH)
    except boundedjson.JSONRefused as e:
        raise BadRequest(f"body {e}") from None
    try:   # "\ud800" escapes parse, but no tokenizer takes a lone surrogate
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise BadRequest("body is not valid JSON: a string holds a lone UTF-16 surrogate") from None
    return body
