"""`shardwise router`'s mistakes are one line and exit 2, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .processes import ROOT


@pytest.mark.parametrize("args, message", [
    ([], "give the replicas: --replicas URL[,URL...] or --replicas-file FILE"),
    (["--replicas", "ftp://x"], "replica address 'ftp://x': expected http://host:port"),
    (["--replicas", "http://a:1", "--rate-limit", "fast"], "--rate-limit 'fast': expected RATE/s"),
    (["--replicas", "http://a:1", "--api-key-file", "/nonexistent/keys"], "cannot read the API key file /nonexistent/keys"),
    (["--replicas", "http://a:1", "--hold-seconds", "-1"], "--hold-seconds -1.0: expected 0 to 3600 seconds"),
])
def test_mistakes_are_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "shardwise", "router", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("pod_ip, reached_on", [("10.0.0.7", "127.0.0.1"), ("127.0.0.9", "127.0.0.9")])
def test_in_a_pod_it_listens_where_the_service_and_port_forward_reach_it(monkeypatch, pod_ip, reached_on):
    """A pod of its own (a cluster address): every address, so `kubectl port-forward` (localhost inside
    the pod) reaches it as the Service does; a local node's pod: only its own loopback address."""
    import urllib.error
    import urllib.request

    from .processes import router_process

    monkeypatch.setenv("POD_IP", pod_ip)
    with router_process(["--replicas", "http://127.0.0.1:9"]) as (base, lines, _):
        port = base.rsplit(":", 1)[1]
        assert base == f"http://{reached_on}:{port}", "".join(lines)
        with urllib.request.urlopen(f"http://{reached_on}:{port}/healthz", timeout=10) as r:
            assert r.status == 200
        if reached_on != "127.0.0.1":
            with pytest.raises(urllib.error.URLError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
