"""`shardwise plan --from-cluster` reads real Nodes and Pods from the local control plane."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest
import yaml

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]


def test_plan_from_cluster_counts_taken_gpus_and_skips_cordoned_nodes(cluster, node_factory, kubectl, namespace, tmp_path):
    pool = f"plan-{secrets.token_hex(3)}"
    names = [node_factory(f"{pool}-{i}", gpus=8, zone="zone-p", rack=f"{pool}-rack-{i % 2}", labels={"pool": pool})
             for i in range(3)]
    # a pod of another workload holds 6 of node 0's GPUs; node 1 is cordoned
    kubectl("create", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other-workload"},
        "spec": {"nodeName": names[0], "containers": [{"name": "c", "image": "busybox",
                                                       "resources": {"limits": {"nvidia.com/gpu": "6"}}}]}}))
    kubectl("cordon", names[1])
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m", "namespace": namespace},
        "spec": {"model": {"uri": "pvc://models/m", "parameters": 8_000_000_000, "layers": 32, "heads": 32, "kvHeads": 8},
                 "parallelism": {"tensor": 4, "pipeline": 2},
                 "placement": {"nodeSelector": {"pool": pool}}}}))
    result = subprocess.run([sys.executable, "-m", "shardwise", "plan", "-f", str(manifest), "--from-cluster", "-o", "json"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    # node 0 has 2 free, node 1 is cordoned: both stages of 4 GPUs go to node 2
    assert [p["node"] for p in plan["placements"]] == [names[2], names[2]]
    assert any("1 cordoned" in n for n in plan["notes"])

    kubectl("cordon", names[2])
    refused = subprocess.run([sys.executable, "-m", "shardwise", "plan", "-f", str(manifest), "--from-cluster"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"shardwise plan: needs 4 GPUs in one NVLink domain; the largest free block is 2 on {names[0]}")
