"""End to end on local nodes: a pod serves as many requests at once as its plan's KV budget admits.
A ShardedModel whose kvCacheTokens admit 32 sequences (the planner's concurrency, in status.plan)
runs its pod with 32 rows: 32 concurrent streams all decode together, every stream's first token
arriving before any stream ends (with the worker's old fixed 8 rows the ninth waited for the first
eight to finish)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from .test_operator_worker import CRD, serving_ip, wait
from ..worker.serving.test_drain import _stream
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]
STREAMS = 32
# Each stream's tokens: an engine that takes turns between one prompt and a decode of every row has
# given the first stream about 32 tokens by the 32nd prompt; twice that leaves a margin.
TOKENS = 64


def test_32_concurrent_streams_to_a_pod_all_decode_together(cluster, namespace, kubectl, node_factory, tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=2, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    node_factory(f"{namespace[-6:]}-cap-0", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "wide"},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                       "serving": {"kvCacheTokens": STREAMS * 512},       # 512 tokens a sequence: 32
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))
        t0 = time.monotonic()
        ip = wait(lambda: serving_ip(kubectl, "wide"), 180, "wide Ready")
        print(f"created -> Ready in {time.monotonic() - t0:.1f} s")
        status = json.loads(kubectl("get", "sm", "wide", "-o", "json"))["status"]
        assert status["plan"]["maxSequences"] == STREAMS

        outs = [{} for _ in range(STREAMS)]
        start = threading.Barrier(STREAMS)

        def one(out: dict) -> None:
            start.wait()
            _stream(f"http://{ip}:8000", out, TOKENS)
            out["ended_at"] = time.monotonic()

        threads = [threading.Thread(target=one, args=(o,)) for o in outs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        print(f"{STREAMS} streams of {TOKENS} tokens in {time.monotonic() - t0:.1f} s")
        assert all("error" not in o and o.get("done") for o in outs), [o.get("error") for o in outs]
        assert all(o["usage"]["completion_tokens"] == TOKENS for o in outs)
        last_first, first_end = max(o["first_at"] for o in outs), min(o["ended_at"] for o in outs)
        assert last_first < first_end, f"a stream started {last_first - first_end:.2f} s after another ended"
