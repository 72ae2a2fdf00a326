"""A remote model's download as a user sees it, pure: which pods to ask (pods_to_ask),
status.download (each replica still fetching, its pods' reports summed), the `Downloading` condition
(Fetching, Stalled, Done) and one `Downloaded` Event per replica attempt, once its pods have their
share in their caches.

The reports come from the pods (operator/controller/download.py reads them, crds/download.py
bounds them). A pod answers while it fetches (its progress server) and, once done, for as long as it
runs (the server that takes its port next answers the fetch's final report: worker/cli/pod.py), so a
download shorter than one read, or a start from a warm node cache (0 bytes fetched), still has its
Event. Why that and not a progress server kept up until someone reads it: the pod would wait on the
operator's polls before it loads (a start from the cache delayed by a poll period) and the port
would have to be handed over; a final report served by whoever holds the port costs the pod nothing.

Which replica attempt's Event was posted is kept in its group record (status.groups[].downloaded),
so the Event is posted once per attempt (a re-planned group fetches again, and has its own), and a
replica is asked only until then: its Ready pods for at most READY_ASK_SECONDS after the group turned
Ready (a pod that never answers, such as one of an older worker image, costs no pass after that).
A replica with no report this pass (its pods not started, or its Event posted) is left out, so
status.download shrinks as replicas finish.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, NamedTuple

from shardwise.crds import names
from shardwise.crds.download import STALL_SECONDS, DownloadReport, replica_download
from shardwise.crds.status import (STATUS_MAX_DOWNLOADS, ConditionType, DownloadReason, GroupPhase,
                                   ReplicaDownload, ReplicaGroupStatus)
from shardwise.operator.decide.actions import Event
from shardwise.operator.decide.conditions import condition, set_condition
from shardwise.operator.decide.recovery import parse_iso, pod_ready

MESSAGE_REPLICAS = 4     # replicas the condition's message names; the rest are counted
# How long after its group turned Ready a replica whose Downloaded Event is not posted yet is still
# asked: a few of the operator's passes (the pass that sees the group Ready asks it at once).
READY_ASK_SECONDS = 120

Pod = Mapping[str, Any]


class Asked(NamedTuple):
    """A replica to ask this pass: its current pods that run, and whether any is not Ready yet
    (fetching or loading: a replica of only Ready pods has fetched, whatever it answers)."""
    replica: int
    pods: list[Pod]
    starting: bool


class Outcome(NamedTuple):
    listed: list[dict]          # status.download
    conditions: list[dict]      # the pass's conditions, Downloading set
    events: list[Event]
    downloaded: frozenset       # replicas whose Downloaded Event this is: their group records keep it


def _given_up(group: ReplicaGroupStatus, now: datetime) -> bool:
    since = parse_iso(group.ready_since) if group.phase in (GroupPhase.READY, GroupPhase.OUTDATED) else None
    return since is not None and (now - since).total_seconds() > READY_ASK_SECONDS


def pods_to_ask(groups: Mapping[int, ReplicaGroupStatus], pods: Mapping[int, list[Pod]],
                now: datetime) -> list[Asked]:
    """The replicas whose current attempt has no Downloaded Event yet, each with its current pods
    that run (Ready or not), in replica order; not one whose group has been Ready longer than
    READY_ASK_SECONDS."""
    out = []
    for replica in sorted(groups):
        g = groups[replica]
        if g.downloaded == g.attempt or _given_up(g, now):
            continue
        current = [p for p in pods.get(replica, [])
                   if (p["metadata"].get("labels") or {}).get(names.LABEL_ATTEMPT) == str(g.attempt)
                   and (p.get("status") or {}).get("phase") == "Running"]
        if current:
            out.append(Asked(replica, current, not all(map(pod_ready, current))))
    return out


def size(n: int) -> str:
    """Bytes as a person reads them: 512 B, 1.5 KiB ... 3.2 TiB."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def _stalled(replica: int, reports: list[DownloadReport], uri: str) -> str:
    worst = max(reports, key=lambda r: r.stalled_seconds)
    if worst.done or worst.stalled_seconds < STALL_SECONDS:
        return ""
    why = f" (retry {worst.retries}: {worst.error})" if worst.error else ""
    return f"replica {replica}: no byte for {int(worst.stalled_seconds)} s from {uri}{why}"


def decide(conditions: list[dict], reports: Mapping[int, list[DownloadReport]], uri: str, stamp: str,
           kept: list[dict] | None = None) -> Outcome:
    """status.download, the conditions with Downloading set, and the Events after this pass.
    `conditions`: the pass's conditions so far; `reports`: the replicas read whole this pass, of
    those pods_to_ask names (so none whose attempt has had its Event); `kept`: status.download
    entries of replicas still fetching that were not (listed as they are, counted as fetching).
    A replica whose every report is done gets its Downloaded Event, with what its pods fetched and
    what their caches already held."""
    fetching, stalled, events, downloaded = [], [], [], set()
    for replica in sorted(reports):
        found = reports[replica]
        if not found:
            continue
        summed = replica_download(replica, found)
        if all(r.done for r in found):
            cached = sum(r.bytes_cached for r in found)
            events.append(Event("Normal", "Downloaded",
                                f"replica {replica} has {uri} in its caches: fetched {size(summed.bytes_fetched)}, "
                                f"{size(cached)} already cached"))
            downloaded.add(replica)
            continue
        fetching.append(summed)
        stalled.append(_stalled(replica, found, uri))
    fetching += [ReplicaDownload.model_validate(d) for d in kept or []]
    fetching.sort(key=lambda d: d.replica)
    listed = [d.to_api() for d in fetching[:STATUS_MAX_DOWNLOADS]]
    if fetching:
        stuck = [s for s in stalled if s]
        reason = DownloadReason.STALLED if stuck else DownloadReason.FETCHING
        named = stuck or [f"replica {d.replica}: {size(d.bytes_fetched)} of {size(d.bytes_total)} ({d.percent}%), "
                          f"{size(d.rate)}/s" for d in fetching]
        more = f"; {len(named) - MESSAGE_REPLICAS} more" if len(named) > MESSAGE_REPLICAS else ""
        conditions = set_condition(conditions, ConditionType.DOWNLOADING.value, True, reason.value,
                                   "; ".join(named[:MESSAGE_REPLICAS]) + more, stamp)
    elif (condition(conditions, ConditionType.DOWNLOADING.value) or {}).get("status") == "True":
        conditions = set_condition(conditions, ConditionType.DOWNLOADING.value, False, DownloadReason.DONE.value,
                                   f"every replica reporting has {uri} in its caches", stamp)
    return Outcome(listed, conditions, events, frozenset(downloaded))
