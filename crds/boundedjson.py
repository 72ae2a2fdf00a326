"""JSON that a client, a pod or a model's files sent, parsed with a bound on its nesting: one rule
for every reader of untrusted JSON in the operator and the worker.

Python's parser recurses once per nesting level and, past the interpreter's recursion limit, raises
RecursionError, which is not a ValueError: a termination message or a request body of four
thousand "[" would escape every `except ValueError` around a plain `json.loads`. So the text is
parsed with that caught, and the value is then walked without recursion, stopping as soon as it is
past the bound: linear in the size of the text, whatever its shape.
"""
from __future__ import annotations

import json
from typing import Any

# A model's config.json nests 3 or 4 deep, its safetensors index 2: far above any real file.
MODEL_JSON_DEPTH = 32


class JSONRefused(ValueError):
    """Text that is not JSON, or nests too deep. Its message is one line that reads after the name
    of what was parsed: "<body> is not valid JSON: ..." or "<body> nests deeper than N levels"."""


def loads(raw: bytes | str, max_depth: int) -> Any:
    """The JSON value in `raw`, or JSONRefused."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JSONRefused(_too_deep(max_depth)) from None
    except ValueError as e:        # JSONDecodeError, and UnicodeDecodeError for bytes
        raise JSONRefused(f"is not valid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if depth(value, max_depth) > max_depth:
        raise JSONRefused(_too_deep(max_depth))
    return value


def depth(value: Any, stop_past: int) -> int:
    """How deeply arrays and objects nest in `value` (a scalar: 0), walked without recursion,
    stopping once past `stop_past`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, level = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, level)
            if deepest > stop_past:
                break
            todo.extend((x, level + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _too_deep(max_depth: int) -> str:
    return f"nests deeper than {max_depth} levels"
