"""A JSON file of a model directory (config.json, generation_config.json, the safetensors index, a
safetensors header), read with bounds: a tenant's download is not trusted to be small or shallow.
Python's parser recurses once per nesting level, so the depth is checked first, without recursion."""
from __future__ import annotations

import json
import os
import re
from typing import Any

from shardwise.worker.errors import WorkerError

# Far above any real file: a config nests 3 or 4 deep, a 1,000-file index is well under 1 MiB.
MAX_BYTES = 64 << 20
MAX_DEPTH = 32
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_INNERMOST = re.compile(rb"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_BRACKETS = re.compile(rb"[\[\]{}]")


def depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether the JSON in `raw` nests deeper than `limit`: strings blanked, then the innermost
    brackets removed up to `limit` times; a bracket left is deeper (or unbalanced, which the parser
    refuses anyway)."""
    text = _STRING.sub(b'""', raw)
    for _ in range(limit):
        if not _BRACKETS.search(text):
            return False
        text = _INNERMOST.sub(b"0", text)
    return bool(_BRACKETS.search(text))


def parse(raw: bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON in `raw`; one WorkerError line naming `where` if it is not JSON or nests too deep."""
    if depth_exceeds(raw, max_depth):
        raise WorkerError(f"{where} is not valid JSON: it nests deeper than {max_depth}")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise WorkerError(f"{where} is not valid JSON: {str(e).splitlines()[0]}") from None


def read_object(path: str, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """The JSON object in the file at `path`, at most `max_bytes` long."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > max_bytes:
                raise WorkerError(f"{path} is larger than {max_bytes} bytes")
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise WorkerError(f"{path} cannot be read: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise WorkerError(f"{path} is larger than {max_bytes} bytes")
    data = parse(raw, path)
    if not isinstance(data, dict):
        raise WorkerError(f"{path} is not a JSON object")
    return data
