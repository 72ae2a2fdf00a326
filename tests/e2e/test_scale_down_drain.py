"""End to end on local nodes: requests streaming from a replica while `kubectl scale` takes that
replica away finish without error. Its pods get SIGTERM; rank 0 turns unready, finishes its
streams, then stops the pipeline, whose other stage exits when the stop reaches it (worker/serving/http/server.py
run_engine, worker/cli/pod.py), all inside the pod's grace period."""
from __future__ import annotations

import json
import threading
import time

import pytest

from .test_operator_worker import CRD, wait
from ..worker.serving.test_drain import NEW_TOKENS, _stream
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(600)]
PIPELINE = 2


def test_streams_finish_while_kubectl_scale_removes_their_replica(cluster, namespace, kubectl, node_factory,
                                                                   tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=4, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    for i in range(2):
        node_factory(f"{namespace[-6:]}-drain-{i}", 2, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "drain"},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"tensor": 1, "pipeline": PIPELINE, "replicas": 2},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        def pods(replica: int, stage: int) -> list[dict]:
            items = json.loads(kubectl("get", "pods", "-l", f"shardwise.dev/model=drain,shardwise.dev/replica={replica},"
                                       f"shardwise.dev/stage={stage}", "-o", "json"))["items"]
            return [p for p in items if not p["metadata"].get("deletionTimestamp")]

        def both_ready():
            st = json.loads(kubectl("get", "sm", "drain", "-o", "json")).get("status", {})
            ips = [pods(r, 0) for r in (0, 1)]
            return st.get("phase") == "Ready" and all(ips) and all(p[0]["status"].get("podIP") for p in ips) and ips

        wait(both_ready, 300, "two replicas Ready")
        ip = pods(1, 0)[0]["status"]["podIP"]       # scaling to 1 removes replica 1
        streams = [{} for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(f"http://{ip}:8000", out)) for out in streams]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all("first_at" in out for out in streams):
            assert time.monotonic() < deadline and all(t.is_alive() or "error" not in out
                                                      for t, out in zip(threads, streams)), streams
            time.sleep(0.01)
        kubectl("scale", "sm", "drain", "--replicas=1")
        for t in threads:
            t.join(120)
        for out in streams:
            assert "error" not in out and out.get("done"), (out.get("error"), len(out["chunks"]))
            assert out["chunks"][-1]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == NEW_TOKENS
        wait(lambda: not pods(1, 0) and not pods(1, 1), 60, "replica 1's pods gone")
