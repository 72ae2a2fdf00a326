"""A very small JSON client for the Kubernetes API, enough for the control plane and the local nodes.

The official `kubernetes` client is heavy to import and turns every object into model classes; the
launcher and the local-node runtime only need GET/POST/PATCH/DELETE and watches on plain dicts, with
the admin client certificate the launcher wrote. One connection per thread, since http.client is not
thread-safe.
"""
from __future__ import annotations

import base64
import http.client
import json
import shutil
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlencode, urlsplit

import yaml


class ApiError(RuntimeError):
    def __init__(self, status: int, reason: str, body: str):
        self.status = status
        self.reason = reason
        self.body = body
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{status} {reason}: {message}")


class Client:
    """JSON over HTTPS to one API server, authenticated by a client certificate."""

    def __init__(self, server: str, ca_file: str, cert_file: str, key_file: str, timeout: float = 30):
        url = urlsplit(server)
        self.host, self.port = url.hostname, url.port or 443
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file)
        self.context.load_cert_chain(cert_file, key_file)
        self._local = threading.local()

    @classmethod
    def from_kubeconfig(cls, path: str | Path, timeout: float = 30) -> "Client":
        """Read a kubeconfig that carries its certificates inline (as the launcher writes them)."""
        config = yaml.safe_load(Path(path).read_text())
        ctx_name = config.get("current-context")
        ctx = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == ctx["user"])
        tmp = Path(tempfile.mkdtemp(prefix="shardwise-kapi-"))

        def materialise(data_key: str, file_key: str, section: dict, name: str) -> str:
            if file_key in section:
                return section[file_key]
            target = tmp / name
            target.write_bytes(base64.b64decode(section[data_key]))
            target.chmod(0o600)
            return str(target)

        try:
            return cls(cluster["server"],
                       materialise("certificate-authority-data", "certificate-authority", cluster, "ca.crt"),
                       materialise("client-certificate-data", "client-certificate", user, "client.crt"),
                       materialise("client-key-data", "client-key", user, "client.key"), timeout)
        finally:
            # The SSL context has read them: leaving them would add a folder per client to /tmp.
            shutil.rmtree(tmp, ignore_errors=True)

    def _conn(self, timeout: float | None = None) -> http.client.HTTPSConnection:
        if timeout is not None:  # watches get their own connection
            return http.client.HTTPSConnection(self.host, self.port, context=self.context,
                                               timeout=timeout)
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.context,
                                               timeout=self.timeout)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None, query: dict | None = None,
                content_type: str = "application/json") -> Any:
        if query:
            path = f"{path}?{urlencode(query)}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):  # one retry on a connection the server closed while idle
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, ConnectionError, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if resp.status >= 400:
            raise ApiError(resp.status, resp.reason, raw.decode(errors="replace"))
        return json.loads(raw) if raw else None

    def get(self, path: str, **query) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: dict) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str, body: dict | None = None) -> Any:
        return self.request("DELETE", path, body)

    def merge_patch(self, path: str, patch: dict) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, patch: dict) -> Any:
        return self.request("PATCH", path, patch,
                            content_type="application/strategic-merge-patch+json")

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60,
              **query) -> Iterator[dict]:
        """Yield watch events ({"type", "object"}) until the server ends the watch."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "timeoutSeconds": str(timeout_seconds), "allowWatchBookmarks": "true", **query}
        conn = self._conn(timeout=timeout_seconds + 15)
        try:
            conn.request("GET", f"{path}?{urlencode(params)}", headers={"Accept": "application/json"})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise ApiError(resp.status, resp.reason, resp.read().decode(errors="replace"))
            buffer = b""
            while True:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
                if not chunk:
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            conn.close()
