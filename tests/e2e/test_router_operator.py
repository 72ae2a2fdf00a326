"""End to end on local nodes: a model of two replicas with spec.serving.router enabled. The
operator runs its router (a Deployment of `shardwise router` pods, the replicas file from the Ready
stage-0 pods), the serving Service selects the router pods, a completion through them equals a
replica's own, and a replica's pod deleted mid-stream loses no stream: each ends with the text of an
undisturbed greedy run. Turning the router off points the Service back at the replicas and removes
the router."""
from __future__ import annotations

import json
import threading
import time

import pytest

from .test_operator_worker import CRD, complete, wait
from ..router.processes import metric, stream
from ..worker.texts import PANGRAMS

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]
NAME = "rt"
ROUTER_LABEL = f"shardwise.dev/router={NAME}"


def _ready(pod: dict) -> bool:
    return bool(not pod["metadata"].get("deletionTimestamp") and pod["status"].get("podIP") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or []))


def test_a_model_with_a_router_answers_through_it_and_a_lost_replica_loses_no_stream(
        cluster, namespace, kubectl, node_factory, tmp_path):
    pytest.importorskip("torch")
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "tiny", PANGRAMS, layers=2, hidden=64, heads=4, kv_heads=2)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    for i in range(2):
        node_factory(f"{namespace[-6:]}-rt-{i}", 1, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    api = f"/api/v1/namespaces/{namespace}"

    def pods(selector: str) -> list[dict]:
        return cluster.client.get(f"{api}/pods?labelSelector={selector}")["items"]

    def ips(selector: str) -> list[str]:
        return sorted(p["status"]["podIP"] for p in pods(selector) if _ready(p))

    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": NAME},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 2},
                       "serving": {"router": {"enabled": True, "replicas": 2}, "maxModelLength": 1024},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))
        workers = f"shardwise.dev/model={NAME},shardwise.dev/stage=0"
        replicas = wait(lambda: len(ips(workers)) == 2 and ips(workers), 180, "both replicas Ready")
        listed = "".join(f"http://{ip}:8000\n" for ip in replicas)
        wait(lambda: cluster.client.get(f"{api}/configmaps/{NAME}-router")["data"]["replicas"] == listed, 30,
             "the router's replicas file listing both replicas")
        # router pods started before the replicas were Ready: the operator's annotation makes their
        # node write the new replicas file, and they route without a restart
        deployment = cluster.client.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{NAME}-router")
        assert deployment["metadata"]["ownerReferences"][0]["name"] == NAME
        routers = wait(lambda: len(ips(ROUTER_LABEL)) == 2 and ips(ROUTER_LABEL), 90, "two router pods Ready")
        assert not set(routers) & set(replicas)

        # (local pods have loopback addresses, which the API server refuses in an EndpointSlice:
        # the Service's pods are found by its selector instead)
        def fronted() -> bool:
            selector = cluster.client.get(f"{api}/services/{NAME}")["spec"]["selector"]
            got = ips(",".join(f"{k}={v}" for k, v in selector.items()))
            assert got == routers, (got, routers, selector)
            return True
        wait(fronted, 30, "the serving Service to select the router pods")
        wait(lambda: stream_text(routers[0], 1)[0] is not None, 60, "the router to reach a replica")
        prompt = "the quick brown fox"
        assert complete(routers[0], prompt) == complete(replicas[0], prompt) == complete(routers[1], prompt)
        _prefix_routing_against_round_robin(routers[0], replicas)

        # two long streams through one router pod; a replica's pod deleted once both give text
        bodies = [{"prompt": f"the quick brown fox {i} jumps", "max_tokens": 600, "temperature": 0} for i in range(2)]
        undisturbed = [stream(f"http://{replicas[1]}:8000", "/v1/completions", b)[0] for b in bodies]
        started = [threading.Event() for _ in bodies]
        results: list = [None] * len(bodies)

        def run(i: int) -> None:
            results[i] = stream(f"http://{routers[0]}:8000", "/v1/completions", bodies[i],
                                on_chunk=lambda n: n >= 5 and started[i].set())
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        victim = next(p for p in pods(workers) if p["status"].get("podIP") == replicas[0])
        kubectl("delete", "pod", victim["metadata"]["name"], "--grace-period=0", "--force", "--wait=false")
        for t in threads:
            t.join(120)
        assert [r[1] for r in results] == ["done", "done"]
        assert [r[0] for r in results] == undisturbed
        moved = metric(f"http://{routers[0]}:8000", "shardwise_router_migrations_total")[""]
        print(f"\n  streams moved to the other replica: {moved:.0f}")

        # off: the Service selects the replicas again, the router is gone
        sm["spec"]["serving"]["router"]["enabled"] = False
        kubectl("apply", "-f", "-", input=json.dumps(sm))
        wait(lambda: cluster.client.get(f"{api}/services/{NAME}")["spec"]["selector"].get("shardwise.dev/stage") == "0",
             30, "the serving Service back on the replicas")
        # the Deployment goes first and its ConfigMap after it, in the same pass: wait for both
        wait(lambda: not cluster.client.exists(f"/apis/apps/v1/namespaces/{namespace}/deployments/{NAME}-router")
             and not cluster.client.exists(f"{api}/configmaps/{NAME}-router"),
             30, "the router's Deployment and ConfigMap deleted")


def _prefix_routing_against_round_robin(router: str, replicas: list[str]) -> None:
    """Chat requests each with one of 4 long system prompts, in a seeded random order, one at a time:
    alternated over the replicas (round robin, as a Service spreads connections), then through the
    router (prefix-aware), each policy with prompts of its own so that neither finds the other's
    cache. Prints TTFT p50/p90 (a 1-token answer's latency) and the share of prompt tokens found in
    a replica's cache; prefix routing finds more."""
    import random
    import statistics
    import urllib.request
    rnd = random.Random(5)
    words = sorted(set(PANGRAMS.replace(".", " ").split()))
    order = [rnd.randrange(4) for _ in range(24)]
    rows = []
    for policy, bases in (("round robin", replicas), ("prefix", [router])):
        systems = [" ".join(rnd.choice(words) for _ in range(120)) for _ in range(4)]
        ttft, cached, prompt_tokens = [], 0, 0
        for i, k in enumerate(order):
            body = {"messages": [{"role": "system", "content": systems[k]},
                                 {"role": "user", "content": f"{rnd.choice(words)} {rnd.choice(words)}"}],
                    "max_tokens": 1, "temperature": 0}
            req = urllib.request.Request(f"http://{bases[i % len(bases)]}:8000/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=60) as r:
                usage = json.loads(r.read())["usage"]
            ttft.append(time.perf_counter() - t0)
            prompt_tokens += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
        q = statistics.quantiles(ttft, n=10)
        rows.append((policy, statistics.median(ttft), q[8], cached / prompt_tokens))
    print("\n  policy       TTFT p50   TTFT p90   prompt tokens cached")
    for policy, p50, p90, hit in rows:
        print(f"  {policy:11}  {p50 * 1e3:6.0f} ms  {p90 * 1e3:6.0f} ms  {hit:6.0%}")
    assert rows[1][3] > rows[0][3], rows


def stream_text(ip: str, tokens: int) -> tuple[str | None, str]:
    text, end = stream(f"http://{ip}:8000", "/v1/completions", {"prompt": "a", "max_tokens": tokens, "temperature": 0})
    return (text if end == "done" else None), end
