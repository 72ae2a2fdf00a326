"""The nodes of a local cluster: the labels that say who runs a node, the Node objects of GPU nodes
with their topology labels, creating them, waiting for them to be Ready, and marking a node down.

A Node labelled `shardwise.dev/local-node=true` is served by the local-node runtime (its pods run as
processes); every other Node is simulated by kwok. `shardwise.dev/node-down=true` takes a node away
from both, so its Lease stops being renewed: the way tests and `shardwise dev node-down` kill a node.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Callable

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.errors import ControlPlaneError

LOCAL_NODE_LABEL = "shardwise.dev/local-node"
NODE_DOWN_LABEL = "shardwise.dev/node-down"
SIMULATED_LABEL = "shardwise.dev/simulated-node"

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_MEMORY_MIB = 81559


def zone_name(i: int) -> str:
    return f"zone-{chr(ord('a') + i)}" if i < 26 else f"zone-{i}"


def node_manifest(name: str, *, gpus: int, zone: str, rack: str, clique: str | None = None,
                  product: str = GPU_PRODUCT, memory_mib: int = GPU_MEMORY_MIB,
                  local: bool = False, extra_labels: dict | None = None) -> dict:
    """A Node object as a GPU node would register it: capacity and the topology labels."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "topology.kubernetes.io/zone": zone,
        "topology.shardwise.dev/rack": rack,
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.count": str(gpus),
        # One NVLink domain per node: the GPUs inside a node talk fast, across nodes they don't.
        "nvidia.com/gpu.clique": clique or f"{rack}.{name}",
        (LOCAL_NODE_LABEL if local else SIMULATED_LABEL): "true",
        **(extra_labels or {}),
    }
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels,
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {},
            "status": {"capacity": resources, "allocatable": dict(resources)}}


def topology(count: int, racks: int, zones: int) -> list[tuple[str, str]]:
    """(zone, rack) for each of `count` nodes: nodes fill racks in contiguous blocks, racks are
    dealt round-robin to zones, so rack-0 and rack-2 share zone-a when there are two zones."""
    racks = max(1, racks)
    zones = max(1, min(zones, racks))
    per_rack = max(1, -(-count // racks))
    out = []
    for i in range(count):
        rack = min(i // per_rack, racks - 1)
        out.append((zone_name(rack % zones), f"rack-{rack}"))
    return out


def create_nodes(client: kapi.Client, manifests: list[dict], parallel: int = 8) -> None:
    def create(manifest: dict) -> None:
        try:
            client.create("/api/v1/nodes", manifest)
        except kapi.ApiError as e:
            if e.status != 409:
                raise
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(create, manifests))


def node_ready(node: dict) -> bool:
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def wait_nodes_ready(client: kapi.Client, names: list[str], timeout: float,
                     check: Callable[[], None] = lambda: None, say=None) -> None:
    """Wait until every named node is Ready. Lists once, then follows a watch: re-listing hundreds
    of nodes several times a second would cost the API server more than the nodes themselves."""
    wanted = set(names)
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    ready: set[str] = set()
    while True:
        listing = client.get("/api/v1/nodes")
        ready = {n["metadata"]["name"] for n in listing["items"] if node_ready(n)} & wanted
        rv = listing["metadata"]["resourceVersion"]
        try:
            while ready != wanted:
                check()
                now = time.monotonic()
                if now > deadline:
                    break
                if say and now - last_report > 5:
                    say(f"  {len(ready)}/{len(wanted)} nodes Ready")
                    last_report = now
                # short watches, so that a crashed component is noticed within a second
                for event in client.watch("/api/v1/nodes", rv, timeout_seconds=1):
                    obj = event["object"]
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if event["type"] == "ERROR":
                        raise kapi.ApiError(obj.get("code", 500), "watch", str(obj))
                    name = obj["metadata"].get("name")
                    if name in wanted:
                        if event["type"] != "DELETED" and node_ready(obj):
                            ready.add(name)
                        else:
                            ready.discard(name)
        except kapi.ApiError as e:
            if e.status == 410:  # resource version too old: list again
                continue
            raise
        if ready == wanted:
            return
        missing = sorted(wanted - ready)
        raise ControlPlaneError(f"nodes not Ready after {timeout:.0f}s: "
                                f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")


def set_node_down(client: kapi.Client, name: str, down: bool, timeout: float = 30) -> None:
    """Stop (down=True) or resume a node's heartbeat. Resuming waits for the node's Lease to be
    renewed, then touches the pods bound to it: kwok does not look again at pods of a node it takes
    back, so without that, pods evicted while the node was down would stay Terminating."""
    since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    client.merge_patch(f"/api/v1/nodes/{name}",
                       {"metadata": {"labels": {NODE_DOWN_LABEL: "true" if down else None}}})
    if down:
        return
    lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            renewed = client.get(lease)["spec"].get("renewTime") or ""
        except kapi.ApiError as e:
            if e.status != 404:
                raise
            renewed = ""
        if renewed >= since:
            break
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"node {name}: heartbeat did not resume in {timeout:.0f}s")
        time.sleep(0.2)
    pods = client.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}")["items"]
    for pod in pods:
        meta = pod["metadata"]
        try:
            client.merge_patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                               {"metadata": {"annotations": {"shardwise.dev/node-up": since}}})
        except kapi.ApiError as e:
            if e.status != 404:
                raise
