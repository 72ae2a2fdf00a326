"""A remote model's pod keeps answering GET /download once its fetch has ended: the progress server
closes, and the server that takes the port next (a later stage's or a training pod's /healthz
server, or rank 0's API) answers the fetch's final report for the pod's life, so the operator reads
how the download ended however short it was. Real servers on loopback, read by the operator's own
reader (operator/controller/download.py)."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from shardwise.crds import names
from shardwise.crds.download import DownloadReport
from shardwise.operator.controller.download import fetch_download
from shardwise.worker.cli.pod_health import StageHealth
from shardwise.worker.fetch.progress import DownloadTracker, ProgressServer
from shardwise.worker.serving.rank import free_port


def _pod(port: int) -> dict:
    return {"metadata": {"name": "m-r0-s1-a0"}, "status": {"podIP": "127.0.0.1", "phase": "Running"},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]}}


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _fetched(cached: int, fetched: int) -> DownloadTracker:
    """A tracker through a fetch: the cache held `cached` bytes of the share and fetched the rest."""
    tracker = DownloadTracker()
    progress = tracker.phase()
    progress(cached, cached + fetched)
    progress(cached + fetched, cached + fetched)
    return tracker


@pytest.mark.parametrize("cached, fetched", [(0, 5 << 20), (7 << 20, 0)], ids=["fetched", "warm-cache"])
def test_a_pod_answers_its_final_report_after_the_fetch_on_the_same_port(cached, fetched):
    port = free_port()
    tracker = _fetched(cached, fetched)
    progress = ProgressServer(tracker, "127.0.0.1", port)
    assert fetch_download(_pod(port)).done is False          # read while it fetched
    tracker.finished()
    progress.close()                                         # the fetch is over: its server goes at once
    assert fetch_download(_pod(port)) is None
    health = StageHealth(1, "127.0.0.1", port, download=tracker.final_body())   # the port's next holder
    try:
        assert _status(port, "/healthz") == 503, "still loading"
        final = fetch_download(_pod(port))
        assert final == DownloadReport(bytes_fetched=fetched, bytes_total=fetched, bytes_cached=cached, done=True)
        health.loaded({"rank": 0, "stage": 1, "tp_rank": 0, "weight_bytes": 1})
        assert _status(port, "/healthz") == 200 and fetch_download(_pod(port)) == final, "and once Ready"
    finally:
        health.close()


def test_a_pod_of_a_model_in_a_path_has_no_download_report():
    port = free_port()
    health = StageHealth(1, "127.0.0.1", port)
    try:
        assert _status(port, names.DOWNLOAD_PROGRESS_PATH) == 404 and fetch_download(_pod(port)) is None
    finally:
        health.close()


def test_rank_zeros_api_answers_the_final_report_and_nothing_else_changes():
    from tests.worker.serving.test_http_framing import serve
    server, app = serve()
    try:
        assert _status(server.port, names.DOWNLOAD_PROGRESS_PATH) == 404, "a model in a path: as before"
        report = DownloadReport(bytes_fetched=2 << 20, bytes_total=2 << 20, bytes_cached=1 << 20, done=True)
        app.download = report.model_dump_json().encode()     # what _rank_main gives it (pod.py ApiOptions)
        assert fetch_download(_pod(server.port)) == report
        assert _status(server.port, "/healthz") == 200
    finally:
        server.close()
