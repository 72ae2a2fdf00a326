"""The autoscaler's read of a serving pod's /metrics trusts nothing: a real HTTP server on 127.0.0.1
whose numbers lie is clamped to what a worker could report, one that floods, drips or sends
garbage is a replica that did not report (never a hang or an exception), and the TTFT histogram
counts the requests since the last read only."""
from __future__ import annotations

import http.server
import time

import pytest

from tests.operator import fakepods

from shardwise.crds.capacity import MAX_SEQUENCES
from shardwise.operator.controller import autoscaler
from shardwise.operator.decide.autoscaling import ReplicaLoad

LIES = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting -5
vllm:num_requests_running 1e30
vllm:gpu_cache_usage_perc NaN
"""


def _histogram(fast: int, slow: int) -> str:
    return ("# TYPE shardwise_time_to_first_token_seconds histogram\n"
            f'shardwise_time_to_first_token_seconds_bucket{{endpoint="/v1/completions",le="0.5"}} {fast}\n'
            f'shardwise_time_to_first_token_seconds_bucket{{endpoint="/v1/completions",le="+Inf"}} {fast + slow}\n'
            f'shardwise_time_to_first_token_seconds_count{{endpoint="/v1/completions"}} {fast + slow}\n'
            "vllm:num_requests_waiting 3\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.25\n")


class _Pod(http.server.BaseHTTPRequestHandler):
    bodies: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802
        body = type(self).bodies.get(self.server.server_address[1], b"")
        if body == b"drip":
            self.send_response(200)
            self.end_headers()
            try:
                for ch in b"vllm:num_requests_waiting 1\n" * 10:
                    self.wfile.write(bytes([ch]))
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
            return
        fakepods.send(self, body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def pods():
    servers = []

    def make(replica: int, body: bytes, uid: str = "") -> dict:
        server = fakepods.serve(_Pod)
        _Pod.bodies[server.server_address[1]] = body
        servers.append(server)
        return {"metadata": {"name": f"m-r{replica}-s0-a0", "uid": uid or f"u{replica}",
                             "labels": {"shardwise.dev/replica": str(replica), "shardwise.dev/stage": "0",
                                        "shardwise.dev/attempt": "0"}},
                "status": {"podIP": "127.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
                "spec": fakepods.http_port(server)}

    yield make
    for s in servers:
        s.shutdown()


def test_lies_are_clamped_and_bad_pods_do_not_report(pods):
    liar = pods(0, LIES.encode())
    flood = pods(1, b"vllm:num_requests_waiting 1\n" + b"#" * (2 << 20))
    drip = pods(2, b"drip")
    garbage = pods(3, b"\x00\xff{not metrics\n" * 10)
    scaler = autoscaler.Autoscaler()
    started = time.monotonic()
    loads = scaler.loads(autoscaler.stage0_pods([liar, flood, drip, garbage], 4))
    assert time.monotonic() - started < autoscaler.METRICS_TIMEOUT + 1.5, "a drip held the read"
    assert loads == {0: ReplicaLoad(waiting=0, running=MAX_SEQUENCES, kv_cache=0)}


def test_only_ready_stage0_pods_of_current_replicas_are_read(pods):
    ready, beyond = pods(0, b""), pods(5, b"")
    unready = pods(1, b"")
    unready["status"]["conditions"][0]["status"] = "False"
    older = pods(0, b"", uid="old")
    older["metadata"]["labels"]["shardwise.dev/attempt"] = "-1"
    chosen = autoscaler.stage0_pods([older, ready, unready, beyond], 3)
    assert list(chosen) == [0] and chosen[0] is ready


def test_ttft_counts_the_requests_since_the_last_read(pods):
    pod = pods(0, _histogram(5, 0).encode())
    scaler = autoscaler.Autoscaler()
    first = scaler.loads({0: pod})[0]
    assert first.ttft_buckets == () and (first.waiting, first.running, first.kv_cache) == (3, 2, 0.25)
    _Pod.bodies[pod["spec"]["containers"][0]["ports"][0]["containerPort"]] = _histogram(6, 9).encode()
    second = scaler.loads({0: pod})[0]
    assert second.ttft_buckets == ((0.5, 1.0), (float("inf"), 10.0))
    scaler.forget([])
    assert scaler.histograms == {}


def test_requests_held_at_router_pods_are_summed_and_bounded(pods):
    """At zero replicas the autoscaler reads the router pods' held-requests gauge: summed over the
    Ready ones; a lie is clamped, a pod that floods, drips or sends garbage holds none."""
    held = "# TYPE shardwise_router_held_requests gauge\nshardwise_router_held_requests {}\n"
    two, three, lie = pods(0, held.format(2).encode()), pods(1, held.format(3).encode()), pods(2, held.format("1e30").encode())
    unready = pods(3, held.format(7).encode())
    unready["status"]["conditions"][0]["status"] = "False"
    bad = [pods(4, b"drip"), pods(5, b"\x00\xff{not metrics\n"), pods(6, held.format(-4).encode())]
    scaler = autoscaler.Autoscaler()
    assert scaler.held([two, three, unready, *bad]) == 5
    assert scaler.held([lie]) == autoscaler.MAX_HELD
    assert scaler.held([]) == 0
