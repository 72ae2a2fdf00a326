"""Reading a training pod's GET /progress trusts nothing: a real HTTP server on 127.0.0.1 that
drips, redirects, floods and lies gets a None (and a log line), never a hang or an exception."""
from __future__ import annotations

import http.server
import json
import time

import pytest

from tests.operator import fakepods

from shardwise.operator.controller import progress


class _Pod(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def do_GET(self) -> None:  # noqa: N802
        mode = type(self).mode
        if mode == "redirect":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/elsewhere")
            self.end_headers()
            return
        if mode == "drip":
            self.send_response(200)
            self.end_headers()
            try:
                for ch in b'{"step": 1, "steps": 10}':
                    self.wfile.write(bytes([ch]))
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            return
        if mode == "drip-headers":
            try:
                for ch in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 100:
                    self.wfile.write(bytes([ch]))
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            return
        body = {"ok": b'{"step": 3, "steps": 10, "loss": 1.5}', "flood": b'{"pad": "' + b"x" * (10 << 20) + b'"}',
                "bad-step": b'{"step": "x", "steps": 10}', "deep": b"[" * 50_000, "elsewhere": b'{"step": 9, "steps": 10}'}[mode]
        fakepods.send(self, body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pod():
    server = fakepods.serve(_Pod)
    yield {"metadata": {"name": "job-r0-s0-a0"}, "status": {"podIP": "127.0.0.1", "phase": "Running",
                                                            "conditions": [{"type": "Ready", "status": "True"}]},
           "spec": fakepods.http_port(server)}
    server.shutdown()


def fetched(pod, mode):
    _Pod.mode = mode
    started = time.monotonic()
    found = progress.job_progress([pod], progress.fetch_progress)
    return found, time.monotonic() - started


def test_a_good_answer_is_read(pod):
    found, _ = fetched(pod, "ok")
    assert found["step"] == 3 and found["loss"] == 1.5


@pytest.mark.parametrize("mode", ["drip", "drip-headers"])
def test_a_drip_ends_at_the_deadline(pod, mode):
    found, took = fetched(pod, mode)
    assert found is None and took < progress.PROGRESS_TIMEOUT + 1.5


def test_a_redirect_is_not_followed(pod):
    assert fetched(pod, "redirect")[0] is None


def test_ten_mebibytes_are_not_read(pod):
    found, took = fetched(pod, "flood")
    assert found is None and took < progress.PROGRESS_TIMEOUT + 1.5


def test_a_step_that_is_not_a_number_is_ignored_with_a_log_line(pod, caplog):
    found, _ = fetched(pod, "bad-step")
    assert found is None
    assert any("ignoring the progress report" in r.getMessage() and "step" in r.getMessage() for r in caplog.records)
    # a finished pod's termination message goes through the same schema
    done = {"metadata": {"name": "p"}, "status": {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": json.dumps({"step": "x"})}}}]}}
    assert progress.job_progress([done], lambda p: None) is None


def test_json_nested_past_the_interpreters_recursion_limit_is_ignored_not_raised(pod):
    # Python's parser raises RecursionError (not a ValueError) on deep nesting: from a pod's answer
    # or its termination message, it would escape the handler as a traceback.
    found, _ = fetched(pod, "deep")
    assert found is None
    done = {"metadata": {"name": "p"}, "status": {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": "[" * 4000}}}]}}
    assert progress.job_progress([done], lambda p: None) is None
