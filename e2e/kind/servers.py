"""Servers the kind suite runs inside the cluster (the S3 store, the model registry): each one
Deployment and one Service in a namespace of its own that enforces Pod Security `restricted`, on the
control-plane node (tolerating its taint), so that a test stopping a worker node never stops the
server its models come from; its data in an emptyDir, its secrets in a Secret of its own name.

    items = servers.manifests(NAMESPACE, NAME, image, PORT, container={...}, secret={...})
    servers.deploy(cluster, items, NAMESPACE, NAME)        # waits until it is Ready
"""
from __future__ import annotations

import json

# The worker image's user: any non-root uid passes `restricted`; this one is the project's.
UID = 10001
READY_TIMEOUT_S = 300
DATA_LIMIT = "2Gi"


def manifests(namespace: str, name: str, image: str, port: int, container: dict, data_path: str,
              secret: dict[str, str], secret_path: str | None = None) -> list[dict]:
    """The namespace, the Secret (mounted at `secret_path` when given), the Deployment and the Service.
    `container` adds to the server's container (args, env, readinessProbe); its data is an emptyDir
    at `data_path`."""
    labels = {"app.kubernetes.io/name": name}
    mounts = [{"name": "data", "mountPath": data_path}]
    volumes: list[dict] = [{"name": "data", "emptyDir": {"sizeLimit": DATA_LIMIT}}]
    if secret_path:
        mounts.append({"name": "secret", "mountPath": secret_path, "readOnly": True})
        volumes.append({"name": "secret", "secret": {"secretName": name}})
    server = {
        "name": name, "image": image, **container,
        "ports": [{"containerPort": port, "name": "server"}],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts}
    pod = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,
        # the control plane: never a worker node a test stops
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "containers": [server], "volumes": volumes}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": namespace, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": secret},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "strategy": {"type": "Recreate"},
                  "template": {"metadata": {"labels": labels}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": labels, "ports": [{"port": port, "targetPort": port, "name": "server"}]}}]


def deploy(cluster, items: list[dict], namespace: str, name: str) -> None:
    """Apply the manifests and wait until the server is Ready."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", namespace,
                    f"--timeout={READY_TIMEOUT_S}s", timeout=READY_TIMEOUT_S + 30)


def remove(cluster, namespace: str) -> None:
    cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
