"""A container's probes: readiness (httpGet, tcpSocket or exec, with its period and thresholds)
decides whether it is ready; liveness failures ask for a restart."""
from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes.containers import ContainerProc
from shardwise.e2e.localcluster.localnodes.podenv import PodEnvironment, Waiting


class Prober:
    """Probes of the containers of one pod, at its IP, exec probes run in its folder and env."""

    def __init__(self, environment: PodEnvironment, ip: str, folder: Path):
        self.environment = environment
        self.ip = ip
        self.folder = folder

    def probe(self, c: ContainerProc, t: float) -> bool:
        """Run the container's probes that are due at `t`; True when its liveness probe failed
        failureThreshold times: the container is to be killed."""
        readiness = c.spec.get("readinessProbe")
        if readiness is None:
            c.ready = True
        elif t >= c.probe_due:
            c.probe_due = t + readiness.get("periodSeconds", 10)
            if self.check(c, readiness):
                c.ready_ok += 1
                c.ready_fail = 0
                if c.ready_ok >= readiness.get("successThreshold", 1):
                    c.ready = True
            else:
                c.ready_fail += 1
                c.ready_ok = 0
                if c.ready_fail >= readiness.get("failureThreshold", 3) or not c.ready:
                    c.ready = False
        liveness = c.spec.get("livenessProbe")
        if liveness is not None and t >= c.live_due:
            c.live_due = t + liveness.get("periodSeconds", 10)
            if self.check(c, liveness):
                c.live_fail = 0
            else:
                c.live_fail += 1
                return c.live_fail >= liveness.get("failureThreshold", 3)
        return False

    def check(self, c: ContainerProc, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        if "httpGet" in probe:
            return self._http(c, probe["httpGet"], timeout)
        if "tcpSocket" in probe:
            port = _port(c, probe["tcpSocket"].get("port"))
            try:
                with socket.create_connection((probe["tcpSocket"].get("host") or self.ip, port),
                                              timeout=timeout):
                    return True
            except OSError:
                return False
        if "exec" in probe:
            try:
                env = self.environment.env(c.spec)
                return subprocess.run(self.environment.rewrite_list(probe["exec"]["command"], env),
                                      env=env, timeout=max(1, timeout), capture_output=True,
                                      cwd=self.folder).returncode == 0
            except (OSError, subprocess.TimeoutExpired, Waiting, kapi.ApiError):
                return False
        return True

    def _http(self, c: ContainerProc, http: dict, timeout: float) -> bool:
        port = _port(c, http.get("port"))
        scheme = (http.get("scheme") or "HTTP").lower()
        host = http.get("host") or self.ip
        url = f"{scheme}://{host}:{port}{http.get('path', '/')}"
        try:
            req = urllib.request.Request(url, headers={
                h["name"]: h["value"] for h in http.get("httpHeaders") or []})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        except Exception:
            return False


def _port(c: ContainerProc, port) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in c.spec.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    return 0
