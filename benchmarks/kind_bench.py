"""The kind cluster, timed: what `shardwise kind build` and `shardwise kind up` cost, and how fast a
sharded model comes up and comes back on real kubelets.

    python benchmarks/kind_bench.py            # images and binaries from the cache where present
    python benchmarks/kind_bench.py --cold     # rebuild the node image first (Go binaries cached)

Prints, in one run:
- image sizes: node, operator, worker (CPU variant), registry;
- the node image's build time (with --cold) and cluster creation from a cached node image, twice
  (the first after the images were just built, the second on a warm page cache), and their ratio;
- `kubectl apply` of examples/smollm2-demo.yaml to Ready with the worker image pulled by fresh nodes,
  then again with the image already on the nodes (the baseline: the pull's share of the first);
- `docker stop` of the node holding stage 1 to the model answering again, and that the answer is
  the same greedy text.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.e2e import build  # noqa: E402

from shardwise.e2e.kind import images
from shardwise.e2e.kind.docker import image_size

from shardwise.e2e.kind import nodeimage

from shardwise.e2e.kind import registry
from shardwise.e2e.kind.cluster import KindCluster  # noqa: E402

DEMO = ROOT / "examples" / "smollm2-demo.yaml"
MODEL, NS = "smollm2-demo", "default"


def quiet(_line: str) -> None:
    pass


def wait(predicate, timeout: float, what: str, interval: float = 2) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"kind_bench: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def phase(cluster: KindCluster) -> str:
    return (cluster.get("sm", MODEL, NS).get("status") or {}).get("phase", "")


def apply_to_ready(cluster: KindCluster) -> float:
    start = time.monotonic()
    cluster.kubectl("apply", "-n", NS, "-f", str(DEMO))
    wait(lambda: phase(cluster) == "Ready", 1200, f"{MODEL} Ready")
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="rebuild the node image before timing")
    parser.add_argument("--name", default="shardwise-bench", help="kind cluster name")
    args = parser.parse_args()

    build.build(say=quiet, wanted=(*build.ALL_BINARIES, *build.KIND_BINARIES))
    t0 = time.monotonic()
    nodeimage.build_node_image(say=quiet, force=args.cold)
    node_build = time.monotonic() - t0
    names = images.build_product("bench", say=quiet)
    registry.build_image(say=quiet)
    print("image sizes:")
    for ref in (nodeimage.NODE_IMAGE, names.operator, names.worker, registry.IMAGE):
        print(f"  {ref:<48} {image_size(ref) / 1e9:6.2f} GB")
    if args.cold:
        print(f"node image build (Go binaries cached): {node_build:6.1f} s")

    cluster = KindCluster(args.name)
    if cluster.exists():
        cluster.delete()
    creates = []
    for _ in range(2):
        t0 = time.monotonic()
        cluster.create(say=quiet)
        creates.append(time.monotonic() - t0)
        cluster.delete()
    print(f"kind create cluster (5 nodes), first: {creates[0]:6.1f} s   again: {creates[1]:6.1f} s   "
          f"ratio {creates[0] / creates[1]:.2f}")

    cluster.create(say=quiet)
    try:
        t0 = time.monotonic()
        pushed = cluster.push_product(names, say=quiet)
        print(f"push operator + worker to the local registry: {time.monotonic() - t0:6.1f} s")
        repository, tag = pushed.operator.rsplit(":", 1)
        cluster.helm("install", "shardwise", str(ROOT / "charts" / "shardwise"), "--namespace",
                     "shardwise-system", "--create-namespace", "--set", f"image.repository={repository}",
                     "--set", f"image.tag={tag}", "--set", f"operator.workerImage={pushed.worker}",
                     "--set", "replicaCount=1", "--wait", "--timeout", "300s")
        first = apply_to_ready(cluster)
        answer = cluster.complete(NS, MODEL, "The capital of France is")
        cluster.kubectl("delete", "sm", MODEL, "-n", NS, "--wait=true")
        wait(lambda: not cluster.ready_pods(NS, f"shardwise.dev/model={MODEL}"), 120, "pods gone")
        again = apply_to_ready(cluster)
        print(f"kubectl apply -> Ready, image pulled by the nodes: {first:6.1f} s   "
              f"image already there: {again:6.1f} s   pull share {1 - again / first:.0%}")

        pods = cluster.ready_pods(NS, f"shardwise.dev/model={MODEL}")
        victim = next(p["spec"]["nodeName"] for p in pods
                      if p["metadata"]["labels"].get("shardwise.dev/stage") == "1")
        cluster.stop_node(victim)
        t0 = time.monotonic()
        notice = wait(lambda: phase(cluster) != "Ready", 300, "the node loss to be noticed")
        wait(lambda: phase(cluster) == "Ready", 1200, f"{MODEL} Ready again")
        same = cluster.complete(NS, MODEL, "The capital of France is") == answer
        print(f"docker stop of a node -> answering again: {time.monotonic() - t0:6.1f} s "
              f"(noticed after {notice:.1f} s; same greedy text: {same})")
        cluster.start_node(victim)
    finally:
        cluster.delete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
