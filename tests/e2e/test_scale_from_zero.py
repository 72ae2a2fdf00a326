"""End to end on local nodes: a model with a router and autoscaling.minReplicas 0, applied at zero
replicas. Its first request is held at the router (no replica exists), the operator reads the
router's held-requests gauge, scales the model 0 -> 1 through the scale subresource, the replica
starts, the router learns of it (the operator annotates the router pod, whose node then writes
its replicas file again) and the held request is answered with the replica's own greedy text. Once
no request has come for scaleDownDelaySeconds, the model goes back to zero. The timeline is printed."""
from __future__ import annotations

import json
import threading
import time

import pytest

from .test_operator_worker import CRD, complete, wait
from .test_router_operator import _ready
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]
NAME = "cold"
DELAY = 6              # scaleDownDelaySeconds
PROMPT = "the quick brown fox"


def test_a_request_held_at_the_router_wakes_a_model_scaled_to_zero_and_it_sleeps_again(
        cluster, namespace, kubectl, node_factory, tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=2, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    node_factory(f"{namespace[-6:]}-cold-0", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    api = f"/api/v1/namespaces/{namespace}"
    path = f"/apis/shardwise.dev/v1alpha1/namespaces/{namespace}/shardedmodels/{NAME}"

    def ips(selector: str) -> list[str]:
        return sorted(p["status"]["podIP"] for p in cluster.client.get(f"{api}/pods?labelSelector={selector}")["items"]
                      if _ready(p))

    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": NAME},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 0},
                       "serving": {"router": {"enabled": True, "replicas": 1}, "maxModelLength": 1024},
                       "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": DELAY,
                                       "periodSeconds": 1},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))
        router = wait(lambda: ips(f"shardwise.dev/router={NAME}"), 90, "the router pod Ready")[0]
        workers = f"shardwise.dev/model={NAME},shardwise.dev/stage=0"
        assert not ips(workers)

        timeline: list[tuple[float, int, int, str]] = []
        t0, done, answered = time.monotonic(), threading.Event(), None

        def sampler() -> None:
            """Replicas, Ready replicas and the autoscaler's reason every 0.25 s; a row per change."""
            while not done.is_set():
                body = cluster.client.get(path)
                status = body.get("status") or {}
                row = (round(time.monotonic() - t0, 1), body["spec"]["parallelism"]["replicas"],
                       status.get("readyReplicas", 0), (status.get("autoscaling") or {}).get("reason", ""))
                if not timeline or row[1:] != timeline[-1][1:]:
                    timeline.append(row)
                time.sleep(0.25)

        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        try:
            text = complete(router, PROMPT)         # held at the router until a replica is Ready
            answered = time.monotonic() - t0
            replica = ips(workers)[0]
            assert text == complete(replica, PROMPT)
            wait(lambda: cluster.client.get(path)["spec"]["parallelism"]["replicas"] == 0, DELAY + 60,
                 "back to zero replicas", 0.25)
            wait(lambda: not ips(workers), 60, "the replica's pods gone")
        finally:
            done.set()
            watcher.join(10)
            print(f"\n  first request answered after {answered:.1f} s" if answered else "\n  first request unanswered")
            print("  t(s)  replicas  ready  reason")
            for row in timeline:
                print(f"{row[0]:6.1f}  {row[1]:8d}  {row[2]:5d}  {row[3]}")
        assert any(row[1] == 1 and row[3] == "ScaledUp" for row in timeline), timeline
        assert any(row[1] == 0 and row[3] == "ScaledToZero" for row in timeline), timeline
        events = json.loads(kubectl("get", "events", "--field-selector", f"involvedObject.name={NAME}",
                                    "-o", "json"))["items"]
        woken = [e["message"] for e in events if e["reason"] == "ScaledUp"]
        assert woken and "held at the router" in woken[0], woken
