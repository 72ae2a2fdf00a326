"""The local checkpoint tier's node directory (spec.checkpoint.local.hostPath), pure.

A hostPath is a directory of the node, read and written by the model's pods: the operator accepts
only the roots it is configured with (`operator run --local-checkpoint-root`, the chart's
`operator.localCheckpoints.roots`), and mounts <root>/<namespace>/<model name>, so a model's pods
see their own directory and nothing else of the node.

hostPath must be one of the roots, not a folder below one: a folder below a root may run through
another model's directory, whose pods can plant a symlink there that the kubelet would follow out
of the root. The path is normalised first (`//` and `.` folded); `..` is refused outright.
"""
from __future__ import annotations

import posixpath
from typing import Iterable

from shardwise.crds.models import ShardedModelSpec


def normalised(path: str) -> str:
    """The path without `.` parts, doubled or trailing slashes; `..` is kept (and refused)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return "/" + "/".join(parts)


def refusal(spec: ShardedModelSpec, roots: Iterable[str]) -> str:
    """Why this spec's local tier cannot be mounted ("" when it can, or has none)."""
    local = spec.checkpoint.local if spec.checkpoint is not None else None
    if local is None:
        return ""
    allowed = [normalised(r) for r in roots]
    path = normalised(local.host_path)
    if not local.host_path.startswith("/") or ".." in path.split("/"):
        return f"checkpoint.local.hostPath {local.host_path!r} must be an absolute path without '..'"
    if path in allowed:
        return ""
    said = ", ".join(allowed) if allowed else "none: the operator allows no local checkpoint tier"
    return (f"checkpoint.local.hostPath {local.host_path} is not a node directory the operator allows "
            f"(allowed: {said})")


def directory(host_path: str, namespace: str, model: str) -> str:
    """The node directory of one model's local tier: <root>/<namespace>/<model name>."""
    return posixpath.join(normalised(host_path), namespace, model)
