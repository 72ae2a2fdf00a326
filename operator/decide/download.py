"""A remote model's download as a user sees it, pure: status.download (each replica still fetching,
its pods' reports summed), the `Downloading` condition (Fetching, Stalled, Done) and an Event when
a replica has its share in its caches.

The reports come from the pods (operator/controller/download.py reads them, crds/download.py
bounds them); a replica with no report this pass (its pods not started, or serving already) is
left out, so status.download shrinks as replicas finish.
"""
from __future__ import annotations

from typing import Any, Mapping

from shardwise.crds.download import STALL_SECONDS, DownloadReport, replica_download
from shardwise.crds.status import STATUS_MAX_DOWNLOADS, ConditionType, DownloadReason, ReplicaDownload
from shardwise.operator.decide.actions import Event
from shardwise.operator.decide.conditions import condition, set_condition

MESSAGE_REPLICAS = 4     # replicas the condition's message names; the rest are counted


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


def decide(status: Mapping[str, Any], conditions: list[dict], reports: Mapping[int, list[DownloadReport]],
           uri: str, stamp: str, kept: list[dict] | None = None) -> tuple[list[dict], list[dict], list[Event]]:
    """(status.download, the conditions with Downloading set, Events) after this pass.
    `status`: the status before it; `conditions`: the pass's conditions so far; `reports`: the
    replicas read whole this pass; `kept`: status.download entries of replicas still fetching that
    were not (listed as they are, counted as fetching)."""
    fetching, stalled, events = [], [], []
    before = {d.get("replica") for d in status.get("download") or [] if isinstance(d, Mapping)}
    for replica in sorted(reports):
        found = reports[replica]
        if not found:
            continue
        summed = replica_download(replica, found)
        if all(r.done for r in found):
            if replica in before:
                cached = sum(r.bytes_cached for r in found)
                events.append(Event("Normal", "Downloaded",
                                    f"replica {replica} has {uri} in its caches: fetched {size(summed.bytes_fetched)}, "
                                    f"{size(cached)} already cached"))
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
    return listed, conditions, events
