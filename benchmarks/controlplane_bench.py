"""How fast the local control plane is ready, and how it copes with 500 simulated GPU nodes.

    python3 benchmarks/controlplane_bench.py [--nodes 500] [--runs 2]

Prints:
- time from `shardwise dev up` to a Ready cluster (4 GPU nodes) with a warm build cache, per phase
  (target: under 30 s);
- time for N simulated nodes (default 500) to be created and Ready on a running control plane,
  against a 50-node baseline measured in the same run (target: under 60 s);
- CPU the components use while those N nodes just heartbeat (20 s window), which is what a laptop
  pays for a big simulated cluster.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shardwise.e2e import build

from shardwise.e2e.localcluster import controlplane as cp
from shardwise.e2e.localcluster import nodes

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return 0.0


def time_to_ready(runs: int) -> list[float]:
    times = []
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as state:
            plane = cp.ControlPlane(state)
            phases: list[tuple[str, float]] = []
            t0 = time.monotonic()

            def say(line: str) -> None:
                phases.append((line, time.monotonic() - t0))
            try:
                build.build(say=say)  # warm cache: returns at once
                plane.up(cp.ClusterSpec(nodes=4, local_nodes=1), say=say)
                times.append(time.monotonic() - t0)
            finally:
                plane.down()
        print(f"  run {i + 1}: ready in {times[-1]:.1f}s")
        for line, at in phases:
            print(f"    {at:5.1f}s  {line}")
    return times


def nodes_ready(plane: cp.ControlPlane, count: int, prefix: str) -> tuple[float, float]:
    client = plane.client()
    manifests = [nodes.node_manifest(f"{prefix}-{i:04d}", gpus=8, zone=zone, rack=rack)
                 for i, (zone, rack) in enumerate(nodes.topology(count, max(1, count // 16), 4))]
    t0 = time.monotonic()
    nodes.create_nodes(client, manifests, parallel=8)
    created = time.monotonic() - t0
    nodes.wait_nodes_ready(client, [m["metadata"]["name"] for m in manifests], 300,
                        plane.check_components)
    return created, time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    if build.missing_binaries():
        print("Kubernetes binaries are not built; run `shardwise dev build` first", file=sys.stderr)
        return 1
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
          f"(other work competes for them); binaries: {build.bin_dir()}")

    print("\n== time to a Ready cluster (4 simulated + 1 local GPU node), warm build cache")
    times = time_to_ready(args.runs)
    median = statistics.median(times)
    print(f"time to Ready cluster: {median:.1f}s median of {len(times)} "
          f"(target < 30s: {median / 30:.2f} of the budget)")

    print(f"\n== {args.nodes} simulated GPU nodes on a running control plane")
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as state:
        plane = cp.ControlPlane(state)
        try:
            plane.up(cp.ClusterSpec(nodes=0), say=lambda s: None)
            base_created, base_ready = nodes_ready(plane, 50, "base")
            print(f"  baseline 50 nodes: created in {base_created:.1f}s, Ready in {base_ready:.1f}s")
            created, ready = nodes_ready(plane, args.nodes, "big")
            print(f"  {args.nodes} nodes: created in {created:.1f}s, Ready in {ready:.1f}s")
            per_base, per_big = base_ready / 50, ready / args.nodes
            print(f"{args.nodes} simulated nodes Ready: {ready:.1f}s (target < 60s: "
                  f"{ready / 60:.2f} of the budget); per node {per_big * 1000:.0f} ms vs "
                  f"{per_base * 1000:.0f} ms at 50 nodes (ratio {per_big / per_base:.2f})")

            window = 20
            before = {c.name: cpu_seconds(c.pid) for c, _ in plane.component_status()}
            time.sleep(window)
            after = {c.name: cpu_seconds(c.pid) for c, _ in plane.component_status()}
            total = sum(after[n] - before[n] for n in after)
            print(f"  CPU while {args.nodes + 50} nodes heartbeat ({window}s window): "
                  + ", ".join(f"{n} {100 * (after[n] - before[n]) / window:.0f}%" for n in after)
                  + f"; total {100 * total / window:.0f}% of one core")
        finally:
            plane.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
