"""Training jobs: what the operator reads of a running or finished job (its progress), and how
that becomes status.training and status.lastCheckpoint.

A training pod serves GET /progress (the job's progress.json from the shared checkpoint volume:
step, steps, loss, the newest checkpoint of each tier: last_checkpoint on the shared claim,
last_local_checkpoint on the node's disk) while it runs, and leaves the same JSON as its
termination message when it finishes. The operator cannot read the volume itself (only the pods
mount it), so it asks a pod of the job; an unreachable pod just leaves the last known figures.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from shardwise.crds import names
from shardwise.crds.models import Checkpoint
from shardwise.operator.decide import recovery
from shardwise.operator.render.renderer import DEFAULT_PORT

PROGRESS_TIMEOUT = 2.0   # seconds; a busy pod answers later, at the next pass
POLL_SECONDS = 10.0      # how often a running job's progress is read (operator run --progress-seconds)

Fetch = Callable[[Mapping[str, Any]], "dict | None"]


def fetch_progress(pod: Mapping[str, Any]) -> dict | None:
    """GET http://<pod IP>:<http port>/progress, or None when the pod does not answer (yet)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = DEFAULT_PORT
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/progress", timeout=PROGRESS_TIMEOUT) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def _first_stage_first(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    def key(p):
        labels = p["metadata"].get("labels") or {}
        return int(labels.get(names.LABEL_REPLICA, 0)), int(labels.get(names.LABEL_STAGE, 0))
    return sorted(pods, key=key)


def job_progress(pods: Iterable[Mapping[str, Any]], fetch: Fetch = fetch_progress) -> dict | None:
    """The job's progress from its current pods: a finished pod's termination message, else the
    first running pod that answers."""
    pods = _first_stage_first(pods)
    for pod in pods:
        if (pod.get("status") or {}).get("phase") == "Succeeded":
            try:
                found = json.loads(recovery.termination_message(pod) or "null")
            except ValueError:
                found = None
            if isinstance(found, dict):
                return found
    for pod in pods:
        if recovery.pod_ready(pod):
            found = fetch(pod)
            if found:
                return found
    return None


def _iso(unix: Any) -> str | None:
    try:
        return recovery.iso(datetime.fromtimestamp(float(unix), timezone.utc))
    except (TypeError, ValueError, OverflowError):
        return None


def status_fields(progress: Mapping[str, Any], checkpoint: Checkpoint) -> dict:
    """status.training, status.lastCheckpoint (the shared tier) and status.lastLocalCheckpoint (the
    local tier) from a progress report (its keys last_checkpoint and last_local_checkpoint)."""
    out: dict[str, Any] = {"training": {k: v for k, v in {
        "step": int(progress.get("step") or 0), "steps": int(progress.get("steps") or 0),
        "loss": progress.get("loss"), "time": _iso(progress.get("time"))}.items() if v is not None}}
    tiers = [("lastCheckpoint", "last_checkpoint", checkpoint.path)]
    if checkpoint.local is not None:
        tiers.append(("lastLocalCheckpoint", "last_local_checkpoint", checkpoint.local.path))
    for field, key, path in tiers:
        found = _checkpoint(progress.get(key), path)
        if found:
            out[field] = found
    return out


def _checkpoint(last: Any, directory: str) -> dict | None:
    """{step, time, path inside the pods} of one tier's newest checkpoint as a progress report says it."""
    if not isinstance(last, Mapping) or last.get("step") is None:
        return None
    name = last.get("name") or (Path(str(last["path"])).name if last.get("path") else None)
    return {k: v for k, v in {"step": int(last["step"]), "time": _iso(last.get("time")),
                              "path": f"{directory.rstrip('/')}/{name}" if name else None}.items() if v is not None}
