"""A remote model's download as the operator reads it from the pods fetching it.

A pod of an hf://, s3:// or oci:// model serves its DownloadReport (crds/download.py) on its http
port at names.DOWNLOAD_PROGRESS_PATH while it fetches, and the fetch's final report once done, for
as long as it runs. Each pass asks the current pods that run of the replicas whose attempt has not
had its Downloaded Event yet (operator/decide/download.py pods_to_ask: Ready ones too, for a while),
whole replicas, at most MAX_PODS_PER_PASS pods, each read under progress.py's deadline and size cap.
A replica counts as read only when every one of its pods asked answered; one that was not (left for
a later pass, or a pod that did not answer) keeps its last entry in status.download while a pod of
it is not Ready. What the pods report becomes status.download and the Downloading condition; a
replica read whole and done gets its Event, and its group record (status.groups[].downloaded) says
so, which ends the asking. The Event is posted once the status holding that record is written
(controller/reconciler.py), so a pass whose write fails posts nothing and the next one reads again.
"""
from __future__ import annotations

import http.client
import time
from datetime import datetime
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from shardwise.crds import names
from shardwise.crds.status import ReplicaDownload, group_records
from shardwise.crds.download import REPORT_MAX_BYTES, DownloadReport, parse_report, replica_download
from shardwise.operator.controller import podhttp, progress
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
    address = podhttp.http_address(pod)
    if address is None:
        return None
    try:
        body = podhttp.get(*address, names.DOWNLOAD_PROGRESS_PATH,
                           time.monotonic() + progress.PROGRESS_TIMEOUT, REPORT_MAX_BYTES)
    except (OSError, ValueError, http.client.HTTPException):
        return None
    return parse_report(body)


def reports(state: ModelState, decision: Decision, fetch: Fetch,
            now: datetime) -> tuple[dict[int, list[DownloadReport]], set[int], set[int]]:
    """(replica -> the reports read, the replicas every pod asked of which answered, the replicas
    with a pod not Ready yet among those to ask). Whole replicas are asked, at most MAX_PODS_PER_PASS
    pods in all (one replica larger than that: its first MAX_PODS_PER_PASS), starting at a replica
    that moves on every poll period, so every replica has its turn however many fetch at once."""
    candidates = download.pods_to_ask(decision.groups, state.pods, now)
    if not candidates:
        return {}, set(), set()
    step = max(1, MAX_PODS_PER_PASS // max(len(c.pods) for c in candidates))   # replicas a pass reads
    first = int(now.timestamp() // progress.POLL_SECONDS) * step % len(candidates)
    found: dict[int, list[DownloadReport]] = {}
    complete: set[int] = set()
    asked = 0
    for replica, pods, _ in candidates[first:] + candidates[:first]:
        if asked and asked + len(pods) > MAX_PODS_PER_PASS:
            break
        taken = pods[:MAX_PODS_PER_PASS]
        asked += len(taken)
        answers = [r for r in map(fetch, taken) if r is not None]
        if answers:
            found[replica] = answers
        if len(answers) == len(pods):
            complete.add(replica)
    return found, complete, {c.replica for c in candidates if c.starting}


def _kept(state: ModelState, found: Mapping[int, list[DownloadReport]], partial: set[int]) -> list[dict]:
    """status.download entries of the replicas fetching that this pass did not read whole: their last
    entry, else what the pods that answered say (never 100%: the others have not said they are done)."""
    before = {d.get("replica"): d for d in state.status.get("download") or [] if isinstance(d, Mapping)}
    kept = []
    for replica in sorted(partial):
        if replica in before:
            try:   # what status held: written by the operator, checked all the same
                kept.append(ReplicaDownload.model_validate(before[replica]).to_api())
            except ValidationError:
                pass
        elif replica in found:
            summed = replica_download(replica, found[replica])
            kept.append({**summed.to_api(), "percent": min(summed.percent, 99)})
    return kept


def apply(new: dict, state: ModelState, decision: Decision, fetch: Fetch, now: datetime) -> list[Event]:
    """Set status.download and the Downloading condition of `new` (the pass's status) for a remote
    model, and the group records of the replicas whose Downloaded Event this pass posts; the Events
    to post once `new` is written. Nothing for any other model."""
    if state.model is None or not state.spec.model.remote_scheme():
        return []
    found, complete, starting = reports(state, decision, fetch, now)
    whole = {r: found[r] for r in complete if r in found}
    out = download.decide(new.get("conditions") or [], whole, state.spec.model.uri, recovery.iso(now),
                          kept=_kept(state, found, starting - complete))
    new["download"] = out.listed or None
    new["conditions"] = out.conditions
    if out.downloaded:
        for replica in out.downloaded:
            group = decision.groups[replica]
            group.downloaded = group.attempt
        new["groups"] = group_records(decision.groups.values())
    return out.events
