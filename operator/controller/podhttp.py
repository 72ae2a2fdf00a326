"""GET from a pod's HTTP port under one deadline and one size cap: how the operator reads what its
pods report (a training pod's /progress, a serving pod's /metrics). A pod runs the tenant's code,
so what it sends is bounded before it is parsed, and a pod that drips or floods costs at most the
deadline."""
from __future__ import annotations

import http.client
import socket
import threading
import time
from typing import Any, Mapping, Optional

from shardwise.operator.render.renderer import DEFAULT_PORT


def http_address(pod: Mapping[str, Any]) -> Optional[tuple[str, int]]:
    """(pod IP, its container port named http), None before the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = DEFAULT_PORT
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    return str(ip), port


def get(host: str, port: int, path: str, deadline: float, max_bytes: int, accept: str = "application/json") -> bytes:
    """The body of a 200 answer, read under one deadline and one size cap (ValueError otherwise). A
    watchdog shuts the socket at the deadline: a per-read timeout alone lets a pod that drips a byte
    a second (in its headers or its body) hold the caller forever."""
    conn = http.client.HTTPConnection(host, port, timeout=max(0.01, deadline - time.monotonic()))
    conn.connect()   # the socket itself: the connection lets go of it once the response is read
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn.sock,))
    watchdog.start()
    try:
        conn.request("GET", path, headers={"Accept": accept})
        resp = conn.getresponse()
        if resp.status != 200:   # a redirect included: it is not followed
            raise ValueError(f"status {resp.status}")
        body = b""
        while len(body) <= max_bytes:
            chunk = resp.read1(max_bytes + 1 - len(body))
            if not chunk:
                break
            body += chunk
        if len(body) > max_bytes:
            raise ValueError(f"{path} answer too large")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path} read past its deadline")
        return body
    finally:
        watchdog.cancel()
        conn.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
