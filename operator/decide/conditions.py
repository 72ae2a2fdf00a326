"""A ShardedModel's status conditions as Kubernetes conventions want them: one per type, and a
lastTransitionTime that changes only when the condition's status flips (pure).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping


def set_condition(conditions: list[dict] | None, type_: str, status: bool, reason: str, message: str,
                  now: str) -> list[dict]:
    """Insert or update one condition; keep lastTransitionTime unless the status flips."""
    out = [dict(c) for c in (conditions or [])]
    value = "True" if status else "False"
    for c in out:
        if c.get("type") == type_:
            if c.get("status") != value:
                c["lastTransitionTime"] = now
            c.update(status=value, reason=reason, message=message)
            return out
    out.append({"type": type_, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": now})
    return out


def condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type_:
            return c
    return None
