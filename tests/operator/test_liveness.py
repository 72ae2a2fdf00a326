"""/healthz fails when a reconcile loop has not completed a pass in a bounded time."""
from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request

from shardwise.operator.cli import run
from shardwise.operator.controller.liveness import Liveness


def test_a_loop_without_a_completed_pass_for_too_long_is_stalled():
    live = Liveness(stall_seconds=60)
    live.completed(("ns", "a"), now=0)
    live.completed(("ns", "b"), now=0)
    assert live.stalled(now=59) == []
    live.completed(("ns", "a"), now=50)
    assert live.stalled(now=100) == ["ns/b"]
    live.forget(("ns", "b"))   # its model is gone
    assert live.stalled(now=100) == []


def test_healthz_is_503_naming_the_stalled_loop(monkeypatch):
    live = Liveness(stall_seconds=60)
    monkeypatch.setattr(run._Health, "stalled", staticmethod(lambda: live.stalled(now=1000)))
    monkeypatch.setattr(run._Health, "alive", threading.Event())
    run._Health.alive.set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), run._Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        live.completed(("ns", "m"), now=990)
        assert urllib.request.urlopen(url, timeout=5).status == 200
        live.completed(("ns", "m"), now=100)
        try:
            urllib.request.urlopen(url, timeout=5)
            raise AssertionError("healthz answered 200 with a stalled loop")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and b"ns/m" in e.read()
    finally:
        server.shutdown()
