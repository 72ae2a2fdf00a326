"""Connections of the HTTP API (worker/serving/http/connections.py), no ranks: slow clients are cut
off at the header and body deadlines, idle connections close, hundreds of idle connections hold
no thread each and do not keep a request waiting, a burst of connections is queued rather than
dropped, and a request whose client hung up is cancelled in the engine."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardwise.worker.serving.http.connections import Timeouts

from .test_http_framing import FakeEngine, completion_ok, exchange, serve, status_and_error

FAST = Timeouts(idle=1.0, headers=1.0, body=1.0, body_rate=1000, write=5.0)


@pytest.fixture(scope="module")
def server():
    srv, _ = serve(server_options={"timeouts": FAST, "workers": 16})
    yield srv
    srv.close()


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> tuple[bool, bytes]:
    """Whether the server closes `sock` within `seconds`, sending `drip` a byte every 0.2 s."""
    got, deadline, i = b"", time.monotonic() + seconds, 0
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        if i < len(drip):
            try:
                sock.send(drip[i:i + 1])
            except OSError:
                return True, got
            i += 1
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_headers_dripped_a_byte_at_a_time_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        closed, _ = _closed_within(s, 4, b"GET /healthz HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 100)
    assert closed
    assert completion_ok(server.port)


def test_a_body_dripped_a_byte_at_a_time_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n")
        closed, got = _closed_within(s, 4, b"{" + b" " * 199)
    assert closed and status_and_error(got)[0] == 408


def test_an_idle_connection_closes(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        assert _closed_within(s, 4)[0]


def test_idle_connections_hold_no_thread_and_do_not_delay_a_request(server):
    before = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(400)]
    try:
        time.sleep(0.3)
        assert completion_ok(server.port)
        assert threading.active_count() - before < 40
    finally:
        for s in socks:
            s.close()


def test_a_burst_of_connections_is_queued_not_dropped(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
           % len(body)) + body
    with ThreadPoolExecutor(200) as pool:
        answers = list(pool.map(lambda _: exchange(server.port, raw), range(200)))
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_hung_up_is_cancelled(stream):
    engine = FakeEngine(delay=0.01)
    srv, _ = serve(engine)
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 3000, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 5
            while not engine.seen and time.monotonic() < deadline:
                time.sleep(0.02)
        deadline = time.monotonic() + 5
        while not engine.seen[0].done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.seen[0].cancelled and len(engine.seen[0].token_ids) < 3000
    finally:
        srv.close()


def test_closing_the_server_lets_an_answer_being_written_finish():
    """The engine can be done with a stream while its thread still writes the last chunks; the pod
    exits right after closing the server, so closing waits for them (up to FLUSH_SECONDS): without
    that, a drained replica's stream ended without its last tokens, error or [DONE]."""
    from shardwise.worker.serving.http.connections import ConnectionServer
    writing = threading.Event()

    def serve_one(conn) -> bool:
        conn.sock.recv(4096)
        writing.set()
        time.sleep(0.5)                 # a thread that is behind with its writes
        conn.sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\ndone")
        return False

    srv = ConnectionServer("127.0.0.1", 0, serve_one, workers=2, timeouts=FAST)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert writing.wait(5)
        began = time.monotonic()
        srv.shutdown()
        assert srv.pool.wait_quiet(5) and time.monotonic() - began >= 0.4
        got = b""
        while not got.endswith(b"done"):
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 OK")
    assert srv.pool.wait_quiet(0), "nothing runs once the answer is written"
