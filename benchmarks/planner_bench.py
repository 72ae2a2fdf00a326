"""Planner speed: plan time for 10, 100 and 1,000 nodes × 8 GPUs.

Target: 1,000 nodes under 1 s, growing no worse than linearly with the node count. Each size is
timed on the same kind of inventory (16 nodes per rack, 4 zones, a third of the GPUs already taken
at random, 2% of nodes cordoned or NotReady) for three ShardedModels:
  - llama-70b, layout left to the planner, 4 replicas;
  - llama-405b, tensor 8, pipeline chosen, replicas filling a quarter of the nodes (grows with N);
  - tiny model, tensor 1 × pipeline 4, replicas on half the GPUs (many small groups).
Times are CPU time of this process (time.process_time), so other work on a shared machine does
not inflate them; wall time on an idle machine is the same within noise. Time includes turning `kubectl get nodes,pods -o yaml` dicts into the inventory; the best of
--repeat runs is kept. Ratios are between sizes measured in the same run; the growth exponent
log(t1000 / t100) / log(10) is 1.0 for linear scaling (below 1: fixed costs still dominate).

    python3 benchmarks/planner_bench.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import random
import math
import sys
import time

from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import ModelFacts, from_hf_config
from shardwise.operator.planning import inventory
from shardwise.operator.planning.planner import plan

LLAMA_70B = from_hf_config(dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                hidden_size=8192, intermediate_size=28672, vocab_size=128256), "bfloat16")
LLAMA_405B = from_hf_config(dict(num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                                 hidden_size=16384, intermediate_size=53248, vocab_size=128256), "bfloat16")
TINY = ModelFacts(layers=32, heads=32, kv_heads=8, hidden=4096, vocab=32000, intermediate=11008,
                  params=6_738_415_616, bytes_per_param=0.1)


def cluster(n: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """kubectl-shaped nodes and the pods holding some of their GPUs."""
    rng = random.Random(seed)
    nodes, pods = [], []
    for i in range(n):
        name = f"gpu-{i:04d}"
        rack = i // 16
        node = {"kind": "Node", "metadata": {"name": name, "labels": {
            "topology.kubernetes.io/zone": f"zone-{rack % 4}", "topology.shardwise.dev/rack": f"rack-{rack:03d}",
            "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "spec": {"unschedulable": rng.random() < 0.01},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "conditions": [
                {"type": "Ready", "status": "True" if rng.random() > 0.01 else "False"}]}}
        nodes.append(node)
        taken = rng.choice([0, 0, 0, 1, 2, 4, 8])
        if taken:
            pods.append({"kind": "Pod", "spec": {"nodeName": name, "containers": [
                {"resources": {"limits": {"nvidia.com/gpu": str(taken)}}}]}, "status": {"phase": "Running"}})
    return nodes, pods


def scenarios(n: int) -> dict[str, tuple[ShardedModelSpec, ModelFacts]]:
    def spec(parallelism: dict) -> ShardedModelSpec:
        return ShardedModelSpec.model_validate({"model": {"uri": "/m"}, "parallelism": parallelism,
                                                "recovery": {"allowShrink": True}})
    return {
        "llama-70b auto ×4": (spec({"replicas": 4}), LLAMA_70B),
        "llama-405b tp8 ×N/4": (spec({"tensor": 8, "replicas": max(1, n // 8)}), LLAMA_405B),
        "tiny tp1 pp4 ×N": (spec({"tensor": 1, "pipeline": 4, "replicas": n}), TINY),
    }


def timed(fn, repeat: int) -> float:
    """CPU seconds of the fastest run: on a shared machine, wall time measures the neighbours too."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sizes = (10, 100, 1000)
    results: dict[str, dict[int, float]] = {}
    for n in sizes:
        raw_nodes, raw_pods = cluster(n)
        for name, (spec, facts) in scenarios(n).items():
            def run() -> None:
                nodes = inventory.build(raw_nodes, raw_pods)
                result = plan(spec, facts, nodes)
                assert result.placements
            results.setdefault(name, {})[n] = timed(run, args.repeat)
            print(f"  {n:5d} nodes  {name:22s} {results[name][n] * 1000:8.1f} ms", file=sys.stderr)
    print(f"\n{'scenario':22s} " + " ".join(f"{n:>9d} n" for n in sizes) + "   ratio 100/10  1000/100  exponent")
    worst = 0.0
    ok = True
    for name, by_size in results.items():
        r1, r2 = by_size[100] / by_size[10], by_size[1000] / by_size[100]
        exponent = math.log(r2) / math.log(10)
        ok &= by_size[1000] < 1.0
        worst = max(worst, by_size[1000])
        print(f"{name:22s} " + " ".join(f"{by_size[n] * 1000:9.1f}ms" for n in sizes)
              + f"   {r1:9.1f}x {r2:8.1f}x   {exponent:6.2f}")
    print(f"\nslowest 1000-node plan: {worst * 1000:.0f} ms (target < 1000 ms): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
