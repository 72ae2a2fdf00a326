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
