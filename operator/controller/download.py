"""A remote model's download as the operator reads it from the pods fetching it.

A pod of an hf://, s3:// or oci:// model serves its DownloadReport (crds/download.py) on its http
port at names.DOWNLOAD_PROGRESS_PATH while it fetches, before it is Ready. Each pass asks the
current pods that run and are not Ready yet, at most MAX_PODS_PER_PASS of them, each read under
progress.py's deadline and size cap; a pod that does not answer is left out this pass. What the
pods report becomes status.download and the Downloading condition (operator/decide/download.py).
"""
from __future__ import annotations

import http.client
import time
from datetime import datetime
from typing import Any, Callable, Mapping

from shardwise.crds import names
from shardwise.crds.download import REPORT_MAX_BYTES, DownloadReport, parse_report
from shardwise.operator.controller import progress
from shardwise.operator.decide import download, recovery
from shardwise.operator.decide.actions import Event
from shardwise.operator.decide.decisions import Decision
from shardwise.operator.decide.state import ModelState

# A pass asks this many pods at most (each bounded by progress.PROGRESS_TIMEOUT): the ones left out
# keep their last figures in status until a later pass reaches them.
MAX_PODS_PER_PASS = 16

Fetch = Callable[[Mapping[str, Any]], "DownloadReport | None"]


def fetch_download(pod: Mapping[str, Any]) -> DownloadReport | None:
    """GET http://<pod IP>:<http port>/download: the pod's report, or None (no answer, not 200,
    too long, too slow, not a report)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = progress.http_port(pod)
    try:
        body = progress.http_get(str(ip), port, names.DOWNLOAD_PROGRESS_PATH,
                             time.monotonic() + progress.PROGRESS_TIMEOUT, REPORT_MAX_BYTES)
    except (OSError, ValueError, http.client.HTTPException):
        return None
    return parse_report(body)


def _fetching(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not recovery.pod_ready(pod)


def reports(state: ModelState, decision: Decision, fetch: Fetch) -> dict[int, list[DownloadReport]]:
    """replica -> its current pods' reports, from at most MAX_PODS_PER_PASS pods still fetching."""
    out: dict[int, list[DownloadReport]] = {}
    asked = 0
    for replica in sorted(decision.groups):
        attempt = str(decision.groups[replica].attempt)
        for pod in state.pods.get(replica, []):
            if pod["metadata"].get("labels", {}).get(names.LABEL_ATTEMPT) != attempt or not _fetching(pod):
                continue
            if asked >= MAX_PODS_PER_PASS:
                return out
            asked += 1
            found = fetch(pod)
            if found is not None:
                out.setdefault(replica, []).append(found)
    return out


def apply(new: dict, state: ModelState, decision: Decision, fetch: Fetch, now: datetime) -> list[Event]:
    """Set status.download and the Downloading condition of `new` (the pass's status) for a remote
    model; the Events to post. Nothing for any other model."""
    if state.model is None or not state.spec.model.remote_scheme():
        return []
    found = reports(state, decision, fetch)
    listed, conditions, events = download.decide(state.status, new.get("conditions") or [], found,
                                                 state.spec.model.uri, recovery.iso(now))
    new["download"] = listed or None
    new["conditions"] = conditions
    return events
