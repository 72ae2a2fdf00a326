"""A fetching pod's download progress: the report it serves, and what status shows of it.

A pod of a remote model (spec.model.uri hf://, s3://, oci://) fetches its files into its cache
before it loads a weight. While it does, it serves DownloadReport as JSON on its http port at
crds/names.py DOWNLOAD_PROGRESS_PATH; the operator reads it (operator/controller/download.py) and
shows each replica's sum in status.download and the `Downloading` condition. The pod is the
tenant's code, so the operator takes the report as untrusted: at most REPORT_MAX_BYTES, nested at
most REPORT_DEPTH, every number bounded, the error cut to ERROR_MAX_CHARS; anything else is ignored.
The worker writes exactly this model (`DownloadReport(...).model_dump_json()`).
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardwise.crds import boundedjson
from shardwise.crds.status import ReplicaDownload, shortened

REPORT_MAX_BYTES = 4 << 10    # a report is about 200 bytes
REPORT_DEPTH = 2              # one flat object
MAX_BYTES = 1 << 60           # far above any model (an exbibyte), low enough for exact float percents
MAX_RATE = 1 << 44            # bytes per second: 16 TiB/s, above any link
ERROR_MAX_CHARS = 256
# How long without a byte before the operator calls a download stalled (the pod's own fetcher times
# out and retries with backoff; this is what a user sees meanwhile).
STALL_SECONDS = 60


class DownloadReport(BaseModel):
    """What one pod says of its fetch (GET /download)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    bytes_fetched: int = Field(0, ge=0, le=MAX_BYTES, description="bytes of this pod's share fetched so far")
    bytes_total: int = Field(0, ge=0, le=MAX_BYTES, description="bytes of this pod's share not in the cache at start")
    bytes_cached: int = Field(0, ge=0, le=MAX_BYTES, description="bytes of its share the cache already held")
    rate: float = Field(0.0, ge=0, le=MAX_RATE, description="bytes per second over the last few seconds")
    stalled_seconds: float = Field(0.0, ge=0, le=10**7, description="seconds since the last byte arrived")
    retries: int = Field(0, ge=0, le=10**6, description="requests retried after a stall or an error")
    done: bool = Field(False, description="every file of its share is in the cache, verified")
    error: Optional[str] = Field(None, description="the last retried error, one line, no credential")

    @field_validator("error")
    @classmethod
    def _one_short_line(cls, text: Optional[str]) -> Optional[str]:
        if text is None:
            return None
        return shortened(" ".join(text.split()), ERROR_MAX_CHARS)


def parse_report(data: bytes | str) -> DownloadReport | None:
    """A pod's report, or None when it is too long, not JSON, or not a report."""
    if len(data) > REPORT_MAX_BYTES:
        return None
    try:
        found = boundedjson.loads(data, REPORT_DEPTH)
        return DownloadReport.model_validate(found) if isinstance(found, dict) else None
    except (ValueError, ValidationError):
        return None


def replica_download(replica: int, reports: list[DownloadReport]) -> ReplicaDownload:
    fetched = sum(r.bytes_fetched for r in reports)
    total = sum(r.bytes_total for r in reports)
    done = all(r.done for r in reports)
    # nothing to fetch is 100% only once done: a pod still listing the store reports a total of 0
    percent = 100 if done else 0 if total == 0 else min(99, fetched * 100 // total)
    return ReplicaDownload(replica=replica, bytes_fetched=fetched, bytes_total=total, percent=percent,
                           rate=int(sum(r.rate for r in reports)))
