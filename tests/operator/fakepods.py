"""Pods the operator reads over HTTP (a training pod's /progress, a pod's /download, a serving pod's
/metrics), played by real HTTP servers on loopback: what they answer is the test's to choose."""
from __future__ import annotations

import http.server
import threading


def send(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
    """A 200 with `body`; a reader that hung up early is no error of the pod's."""
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    try:
        handler.wfile.write(body)
    except OSError:
        pass


def serve(handler: type) -> http.server.ThreadingHTTPServer:
    """A server of `handler` on a free loopback port, serving from a daemon thread until shutdown()."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def http_port(server: http.server.ThreadingHTTPServer) -> dict:
    """A pod spec whose container port named http is the server's."""
    return {"containers": [{"ports": [{"name": "http", "containerPort": server.server_address[1]}]}]}
