"""A fetching pod's download report (crds/download.py), taken as untrusted: bounded and validated."""
from __future__ import annotations

import json

from shardwise.crds.download import (ERROR_MAX_CHARS, MAX_BYTES, REPORT_MAX_BYTES, DownloadReport, parse_report,
                                     replica_download)


def test_a_report_the_worker_writes_reads_back_exactly():
    report = DownloadReport(bytes_fetched=3 << 30, bytes_total=8 << 30, bytes_cached=1 << 30, rate=2.5e8,
                            stalled_seconds=0.5, retries=1, done=False, error="timed out reading s3://m/x")
    assert parse_report(report.model_dump_json()) == report


def test_what_is_not_a_report_is_none_never_an_exception():
    for bad in (b"", b"null", b"[1, 2]", b"{", b'{"bytes_fetched": -1}', b'{"bytes_total": "lots"}',
                json.dumps({"bytes_fetched": MAX_BYTES + 1}).encode(), b'{"rate": 1e300}',
                b'{"a": {"b": {"c": 1}}}', b'{"pad": "' + b"x" * REPORT_MAX_BYTES + b'"}'):
        assert parse_report(bad) is None, bad[:40]


def test_unknown_fields_are_ignored_and_an_error_is_one_short_line():
    report = parse_report(json.dumps({"bytes_fetched": 5, "future_field": 1, "error": "a\nb\r\n" + "x" * 3000}))
    assert report.bytes_fetched == 5
    assert "\n" not in report.error and len(report.error) == ERROR_MAX_CHARS and report.error.startswith("a b x")


def test_a_replicas_download_sums_its_pods_and_is_100_percent_only_when_every_pod_is_done():
    pods = [DownloadReport(bytes_fetched=10, bytes_total=40, rate=5), DownloadReport(bytes_fetched=60, bytes_total=60,
                                                                                    rate=0, done=True)]
    summed = replica_download(2, pods)
    assert (summed.replica, summed.bytes_fetched, summed.bytes_total, summed.percent, summed.rate) == (2, 70, 100, 70, 5)
    almost = replica_download(0, [DownloadReport(bytes_fetched=100, bytes_total=100)])
    assert almost.percent == 99, "not done until the files are verified"
    warm = replica_download(0, [DownloadReport(bytes_total=0, bytes_cached=10 << 30, done=True)])
    assert warm.percent == 100 and warm.bytes_fetched == 0
    listing = replica_download(0, [DownloadReport(bytes_total=0)])
    assert listing.percent == 0, "a pod still listing the store has fetched nothing yet"
