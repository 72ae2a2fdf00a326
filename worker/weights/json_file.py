"""A JSON file of a model directory (config.json, generation_config.json, the safetensors index, a
safetensors header), read with bounds: a tenant's download is not trusted to be small or shallow
(crds/boundedjson.py holds the nesting rule)."""
from __future__ import annotations

import os
from typing import Any

from shardwise.crds import boundedjson
from shardwise.worker.errors import WorkerError

# Far above any real file: a 1,000-file index is well under 1 MiB.
MAX_BYTES = 64 << 20
MAX_DEPTH = boundedjson.MODEL_JSON_DEPTH


def parse(raw: bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON in `raw`; one WorkerError line naming `where` if it is not JSON or nests too deep."""
    try:
        return boundedjson.loads(raw, max_depth)
    except boundedjson.JSONRefused as e:
        raise WorkerError(f"{where} {e}") from None


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
