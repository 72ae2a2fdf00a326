"""Operator benchmark on the local control plane: 200 simulated nodes x 8 GPUs, 50 ShardedModels.

Prints, measured in this run:
  - time from applying 50 ShardedModels to all of them Ready, against a baseline: as many pods with
    the same GPU requests created directly by one client, no operator - the floor the API server,
    scheduler and kwok set;
  - time to recover from losing a node: deleted (the operator reacts to the watch event) and
    NotReady (the node lifecycle controller must first notice the missing heartbeat; that part is
    reported separately);
  - API requests per reconcile and reconcile time, from the operator's own /metrics.

    python3 benchmarks/operator_bench.py [--nodes 200] [--models 50]
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
SHAPES = [(8, 2, 1), (4, 2, 2), (2, 4, 2)]  # (tensor, pipeline, replicas): 16 GPUs each


def say(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_manifest(i: int, ns: str) -> dict:
    tensor, pipeline, replicas = SHAPES[i % len(SHAPES)]
    return {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": f"m{i:02d}", "namespace": ns},
            "spec": {"model": {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": 32, "heads": 32,
                               "kvHeads": 8, "hiddenSize": 4096, "vocabSize": 128256},
                     "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": replicas},
                     "recovery": {"backoffSeconds": 0, "maxRestarts": 10}}}


class Bench:
    def __init__(self, kubeconfig: Path, bin_dir: Path):
        from kubernetes import client, config
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.kubeconfig, self.bin_dir = kubeconfig, bin_dir

    def kubectl(self, *args: str, input: str | None = None) -> str:
        proc = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise SystemExit(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def models(self, ns: str) -> list[dict]:
        return self.custom.list_namespaced_custom_object("shardwise.dev", "v1alpha1", ns, "shardedmodels")["items"]

    def wait_models(self, ns: str, done, what: str, timeout: float = 600) -> float:
        t0 = time.monotonic()
        last = 0.0
        while True:
            items = self.models(ns)
            ok = sum(bool(done(m)) for m in items)
            now = time.monotonic()
            if ok == len(items) and items:
                return now - t0
            if now - last > 5:
                say(f"  {what}: {ok}/{len(items)} after {now - t0:.0f}s")
                last = now
            if now - t0 > timeout:
                raise SystemExit(f"{what}: only {ok}/{len(items)} after {timeout:.0f}s")
            time.sleep(0.25)


def ready(m: dict) -> bool:
    st = m.get("status") or {}
    return st.get("phase") == "Ready" and st.get("observedGeneration") == m["metadata"]["generation"]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        metric = re.sub(r"\{.*\}", "", name)
        out[metric] = out.get(metric, 0.0) + float(value)
    return out


def baseline_direct_pods(bench: Bench, ns: str, pods: list[tuple[str, int]]) -> float:
    """As many pods with the same GPU requests, created by one client and placed by the scheduler:
    no planning, no operator, no status. What the control plane alone takes."""
    from kubernetes.client.rest import ApiException
    t0 = time.monotonic()
    for name, gpus in pods:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"bench": "direct"}},
               "spec": {"restartPolicy": "Never",
                        "containers": [{"name": "c", "image": "none",
                                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}
        try:
            bench.core.create_namespaced_pod(ns, pod)
        except ApiException as e:
            raise SystemExit(f"baseline pod {name}: {e.reason}")
    want = len(pods)
    while True:
        pods = bench.core.list_namespaced_pod(ns, label_selector="bench=direct").items
        ready_pods = sum(any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
                         for p in pods)
        if ready_pods == want:
            return time.monotonic() - t0
        if time.monotonic() - t0 > 300:
            raise SystemExit(f"baseline: {ready_pods}/{want} pods Ready after 300s")
        time.sleep(0.25)


def delete_baseline(bench: Bench, ns: str) -> None:
    bench.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force")
    while bench.core.list_namespaced_pod(ns).items:
        time.sleep(0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--racks", type=int, default=20)
    args = parser.parse_args()

    from shardwise.e2e import build

    from shardwise.e2e.localcluster import controlplane as cp, nodes
    bin_dir = build.bin_dir()
    if build.missing_binaries(bin_dir):
        print("operator_bench: Kubernetes binaries not built; run `shardwise dev build`", file=sys.stderr)
        return 2
    state = Path(tempfile.mkdtemp(prefix="shardwise-opbench-"))
    plane = cp.ControlPlane(state, bin_dir)
    say(f"starting the local control plane with {args.nodes} simulated nodes x 8 GPUs in {args.racks} racks")
    plane.up(cp.ClusterSpec(nodes=args.nodes, gpus_per_node=8, racks=args.racks, zones=2), say=lambda s: None,
             timeout=300)
    operator = None
    try:
        bench = Bench(plane.kubeconfig, bin_dir)
        bench.kubectl("apply", "--server-side", "-f", str(CRD))
        bench.kubectl("wait", "--for=condition=Established", "crd/shardedmodels.shardwise.dev", "--timeout=60s")
        for ns in ("bench", "baseline"):
            bench.kubectl("create", "namespace", ns)
        shards = sum(SHAPES[i % len(SHAPES)][1] * SHAPES[i % len(SHAPES)][2] for i in range(args.models))
        say(f"baseline: {shards} pods with the same GPU requests, created directly")
        baseline = baseline_direct_pods(bench, "baseline", [
            (f"m{i:02d}-{k}", SHAPES[i % len(SHAPES)][0]) for i in range(args.models)
            for k in range(SHAPES[i % len(SHAPES)][1] * SHAPES[i % len(SHAPES)][2])])
        delete_baseline(bench, "baseline")

        metrics_port = free_port()
        log = open(state / "operator.log", "wb")
        operator = subprocess.Popen(
            [sys.executable, "-m", "shardwise", "operator", "run", "--kubeconfig", str(plane.kubeconfig),
             "--namespace", "bench", "--lease-namespace", "bench", "--metrics-port", str(metrics_port),
             "--health-port", "0", "--bind-address", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT)
        time.sleep(3)

        # 1. Create -> all Ready.
        manifests = [model_manifest(i, "bench") for i in range(args.models)]
        say(f"applying {args.models} ShardedModels ({shards} pods, "
            f"{sum(16 for _ in manifests)} of {args.nodes * 8} GPUs)")
        t0 = time.monotonic()
        bench.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
        bench.wait_models("bench", ready, "Ready")
        to_ready = time.monotonic() - t0
        m0 = scrape(metrics_port)

        placements = [p["node"] for m in bench.models("bench") for p in m["status"]["plan"]["placements"]]

        # 2. Lose a node: deleted.
        def holders(node: str) -> set[str]:
            return {m["metadata"]["name"] for m in bench.models("bench")
                    if any(p["node"] == node for p in m["status"]["plan"]["placements"])}

        def restarts(names: set[str]) -> dict[str, int]:
            return {m["metadata"]["name"]: m["status"].get("restarts", 0) for m in bench.models("bench")
                    if m["metadata"]["name"] in names}

        def recovered(names: set[str], before: dict[str, int]):
            return lambda m: m["metadata"]["name"] not in names or (
                ready(m) and m["status"].get("restarts", 0) > before[m["metadata"]["name"]])

        busy = sorted(set(placements))
        victim = busy[0]
        hit = holders(victim)
        before = restarts(hit)
        say(f"deleting node {victim} (holds shards of {len(hit)} model(s))")
        t0 = time.monotonic()
        bench.kubectl("delete", "node", victim, "--wait=false")
        recover_deleted = bench.wait_models("bench", recovered(hit, before), "recovered from node deletion")

        # 3. Lose a node: heartbeat stops (NotReady after the lifecycle controller's grace period).
        victim = busy[len(busy) // 2]
        hit = holders(victim)
        before = restarts(hit)
        say(f"stopping node {victim}'s heartbeat (holds shards of {len(hit)} model(s))")
        t0 = time.monotonic()
        bench.kubectl("label", "node", victim, f"{nodes.NODE_DOWN_LABEL}=true")
        while True:
            node = bench.core.read_node(victim)
            if any(c.type == "Ready" and c.status != "True" for c in node.status.conditions or []):
                break
            time.sleep(0.2)
        detect = time.monotonic() - t0
        recover_not_ready = detect + bench.wait_models("bench", recovered(hit, before), "recovered from NotReady")
        m1 = scrape(metrics_port)

        reconciles = m1.get("shardwise_reconcile_duration_seconds_count", 0)
        requests = m1.get("shardwise_api_requests_total", 0)
        seconds = m1.get("shardwise_reconcile_duration_seconds_sum", 0)
        create_reconciles = m0.get("shardwise_reconcile_duration_seconds_count", 0)
        create_requests = m0.get("shardwise_api_requests_total", 0)
        say("")
        say(f"operator benchmark: {args.nodes} nodes x 8 GPUs, {args.models} ShardedModels, {shards} pods")
        say(f"  all Ready after apply            {to_ready:7.1f} s")
        say(f"  baseline: same pods, no operator {baseline:7.1f} s   (operator / baseline = {to_ready / baseline:.2f}x)")
        say(f"  recover, node deleted            {recover_deleted:7.1f} s   (to Ready again, every model hit)")
        say(f"  recover, node NotReady           {recover_not_ready:7.1f} s   "
            f"(of which {detect:.1f} s until the control plane marked it NotReady)")
        say(f"  reconciles                       {reconciles:7.0f}     "
            f"({create_reconciles:.0f} while creating)")
        say(f"  API requests per reconcile       {requests / max(1, reconciles):7.2f}     "
            f"(creating: {create_requests / max(1, create_reconciles):.2f})")
        say(f"  mean reconcile time              {1000 * seconds / max(1, reconciles):7.1f} ms")
        say(f"  plans made                       {m1.get('shardwise_plan_duration_seconds_count', 0):7.0f}     "
            f"mean {1000 * m1.get('shardwise_plan_duration_seconds_sum', 0) / max(1, m1.get('shardwise_plan_duration_seconds_count', 1)):.1f} ms")
        return 0
    finally:
        if operator is not None:
            operator.terminate()
            try:
                operator.wait(15)
            except subprocess.TimeoutExpired:
                operator.kill()
        plane.down()


if __name__ == "__main__":
    sys.exit(main())
