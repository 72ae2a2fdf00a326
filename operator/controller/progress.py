"""Training jobs: what the operator reads of a running or finished job (its progress), and how
that becomes status.training and status.lastCheckpoint.

A training pod serves GET /progress (the job's progress.json from the shared checkpoint volume:
step, steps, loss, the newest checkpoint of each tier: last_checkpoint on the shared claim,
last_local_checkpoint on the node's disk) while it runs, and leaves the same JSON as its
termination message when it finishes. The operator cannot read the volume itself (only the pods
mount it), so it asks a pod of the job; an unreachable pod just leaves the last known figures.
"""
from __future__ import annotations

import http.client
import logging
import time
from pathlib import Path
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardwise.crds import boundedjson, names
from shardwise.crds.models import Checkpoint
from shardwise.operator.decide import recovery
from shardwise.operator.controller import podhttp

log = logging.getLogger("shardwise.operator")
PROGRESS_TIMEOUT = 2.0   # seconds for the whole read; a busy pod answers later, at the next pass
PROGRESS_MAX_BYTES = 64 << 10   # a progress report is a few hundred bytes
POLL_SECONDS = 10.0      # how often a running job's progress is read (operator run --progress-seconds)
PROGRESS_DEPTH = 8      # a progress report nests two or three deep

Fetch = Callable[[Mapping[str, Any]], "dict | None"]


class _CheckpointReport(BaseModel):
    model_config = ConfigDict(extra="ignore")
    step: int = Field(ge=0)
    name: Optional[str] = Field(None, max_length=1024)
    path: Optional[str] = Field(None, max_length=4096)
    time: Optional[float] = None


class ProgressReport(BaseModel):
    """What the operator accepts of a pod's progress report (GET /progress, or its termination
    message): a pod is the tenant's code, so anything else is ignored, with a log line."""
    model_config = ConfigDict(extra="ignore")
    step: int = Field(0, ge=0)
    steps: int = Field(0, ge=0)
    loss: Optional[float] = None
    time: Optional[float] = None
    last_checkpoint: Optional[_CheckpointReport] = None
    last_local_checkpoint: Optional[_CheckpointReport] = None


def checked(found: Any, pod: Mapping[str, Any]) -> dict | None:
    """The report as the schema has it (None, logged, when it does not fit)."""
    if not found:
        return None
    try:
        return ProgressReport.model_validate(found).model_dump(exclude_none=True)
    except ValidationError as e:
        first = e.errors()[0]
        log.warning(f"ignoring the progress report of pod {pod['metadata'].get('name')}: "
                    f"{'.'.join(map(str, first['loc'])) or 'report'}: {first['msg']}")
        return None


def fetch_progress(pod: Mapping[str, Any]) -> dict | None:
    """GET http://<pod IP>:<http port>/progress, or None when the pod does not answer (yet), answers
    with anything but 200 (a redirect is not followed), sends more than PROGRESS_MAX_BYTES, or takes
    longer than PROGRESS_TIMEOUT in all (a slow drip included)."""
    address = podhttp.http_address(pod)
    if address is None:
        return None
    try:
        return boundedjson.loads(podhttp.get(*address, "/progress", time.monotonic() + PROGRESS_TIMEOUT,
                                             PROGRESS_MAX_BYTES), PROGRESS_DEPTH)
    except (OSError, ValueError, http.client.HTTPException):
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
                found = boundedjson.loads(recovery.termination_message(pod) or "null", PROGRESS_DEPTH)
            except ValueError:
                found = None
            found = checked(found, pod) if isinstance(found, dict) else None
            if found is not None:
                return found
    for pod in pods:
        if recovery.pod_ready(pod):
            found = checked(fetch(pod), pod)
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
