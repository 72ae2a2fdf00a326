"""End to end on local nodes: autoscaling on queue depth. A model of one replica serving one
request at a time (maxConcurrentRequests 1) meets a ramp of concurrent streams; the operator reads
its replicas' /metrics (the model-server protocol's queue gauge), scales it up to three replicas
through the scale subresource, and, once the load is gone and scaleDownDelaySeconds has passed,
back down to one. The timeline of replicas, Ready replicas and queue depth per replica is printed.
Every request of the load completes."""
from __future__ import annotations

import json
import threading
import time

import pytest

from .test_operator_worker import CRD, wait
from ..worker.serving.test_drain import _stream
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(400)]
MAX_REPLICAS = 3
CLIENTS = 12           # on 3 replicas of one row each: 3 waiting per replica, above the target of 2
DELAY = 8              # scaleDownDelaySeconds


def test_a_load_ramp_scales_a_model_from_1_to_3_replicas_and_back(cluster, namespace, kubectl, node_factory,
                                                                   tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=2, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    for i in range(MAX_REPLICAS):
        node_factory(f"{namespace[-6:]}-as-{i}", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    path = f"/apis/shardwise.dev/v1alpha1/namespaces/{namespace}/shardedmodels/ramp"
    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "ramp"},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},
                       "serving": {"maxConcurrentRequests": 1},
                       "autoscaling": {"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "targetValue": 2,
                                       "scaleDownDelaySeconds": DELAY, "periodSeconds": 1},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        def ips() -> list[str]:
            pods = cluster.client.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=shardwise.dev/model=ramp,"
                                      f"shardwise.dev/stage=0")["items"]
            return sorted(p["status"]["podIP"] for p in pods if not p["metadata"].get("deletionTimestamp")
                          and p["status"].get("podIP") and any(c["type"] == "Ready" and c["status"] == "True"
                                                               for c in p["status"].get("conditions") or []))

        wait(lambda: ips(), 180, "the first replica Ready")
        timeline: list[tuple[float, int, int, object, str]] = []
        latest: list[tuple[int, int]] = [(1, 1)]
        t0, stop, done, results = time.monotonic(), threading.Event(), threading.Event(), []

        def sampler() -> None:
            """The model's replicas, Ready replicas and autoscaling status every 0.25 s; a row per change."""
            while not done.is_set():
                body = cluster.client.get(path)
                status = body.get("status") or {}
                auto = status.get("autoscaling") or {}
                row = (round(time.monotonic() - t0, 1), body["spec"]["parallelism"]["replicas"],
                       status.get("readyReplicas", 0), auto.get("observedValue"), auto.get("reason", ""))
                if not timeline or row[1:] != timeline[-1][1:]:
                    timeline.append(row)
                latest[0] = row[1:3]
                time.sleep(0.25)

        def client(i: int) -> None:
            time.sleep(i * 0.3)                     # the ramp: one more stream every 0.3 s
            while not stop.is_set():
                now = ips()
                out: dict = {}
                _stream(f"http://{now[i % len(now)]}:8000", out, 48)
                results.append(out)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        for t in threads:
            t.start()
        try:
            wait(lambda: latest[0] == (MAX_REPLICAS, MAX_REPLICAS), 120, f"{MAX_REPLICAS} replicas Ready", 0.25)
            time.sleep(3)                           # serve the load on all of them for a moment
        finally:
            stop.set()
            stopped = time.monotonic() - t0
            for t in threads:
                t.join(120)
        try:
            wait(lambda: latest[0] == (1, 1), DELAY + 60, "back to 1 replica", 0.25)
        finally:
            done.set()
            watcher.join(10)
            print(f"\n  t(s)  replicas  ready  queue/replica  reason      (load stopped at {stopped:.1f} s)")
            for row in timeline:
                print(f"{row[0]:6.1f}  {row[1]:8d}  {row[2]:5d}  {str(row[3]):>13}  {row[4]}")
        failed = [r.get("error") for r in results if "error" in r or not r.get("done")]
        assert results and not failed, failed
        assert any(row[1] > 1 and row[4] == "ScaledUp" for row in timeline)
        assert max(row[1] for row in timeline) == MAX_REPLICAS
        down = next(row for row in timeline if row[0] > stopped and row[1] == 1)
        assert down[4] == "ScaledDown" or down[4] == "", timeline
        assert down[0] >= stopped + DELAY - 0.5, "scaled down before the load had been low for the delay"
        events = json.loads(kubectl("get", "events", "--field-selector", "involvedObject.name=ramp", "-o", "json"))
        reasons = {e["reason"] for e in events["items"]}
        assert {"ScaledUp", "ScaledDown"} <= reasons, reasons
