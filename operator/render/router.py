"""The model's router, pure: spec.serving.router -> a Deployment of `shardwise router` pods, the
ConfigMap of its replicas file, and the router pods' NetworkPolicy.

The router pods run the operator's own image (settings.router_image, which `operator run
--router-image` sets and the chart passes), never spec.image nor the worker image: a user's image
is the workers' business, the front door of the model is the operator's, and the worker image has
no aiohttp. They listen on the model's
serving port, so the serving Service (renderer.render_serving_service) keeps its port and only
changes its selector to LABEL_ROUTER.

The replicas file lists `http://<podIP>:<port>` of every Ready stage-0 pod (one per replica); the
operator keeps the ConfigMap current (controller/routers.py) and the router re-reads the file when
its mounted copy changes. A kubelet refreshes a ConfigMap volume at its periodic sync (up to about
a minute), or at once when the pod itself is updated: so the operator annotates each router pod
with the new file's digest (replicas_digest, ANNOTATION_ROUTER_REPLICAS), and a new replica - the
first, after a scale from zero - is routed to within seconds. A replica that fails is skipped at
once anyway (the router's health checks and failed connections).

Router pods carry LABEL_ROUTER, not LABEL_MODEL: they are no worker (the operator's pod lists, the
disruption budget and the model's NetworkPolicy all select LABEL_MODEL), and the workers' policy
admits them to the serving port alone, not to the rendezvous and collectives.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

from shardwise.crds import names
from shardwise.crds.models import ShardedModel
from shardwise.crds.router import hold_seconds
from shardwise.operator.render import netpolicy
from shardwise.operator.render.renderer import (WORKER_CONTAINER_SECURITY, WORKER_POD_SECURITY,
                                                _api_keys, owner_reference, router_enabled)
from shardwise.operator.render.settings import Settings, current

REPLICAS_MOUNT = "/etc/shardwise/router"
REPLICAS_FILE = "replicas"
REPLICAS_PATH = f"{REPLICAS_MOUNT}/{REPLICAS_FILE}"
# A router holds no model: a little CPU and memory (its prefix index is bounded).
RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
GRACE_SECONDS = 30      # streams it is forwarding finish or move meanwhile


def labels(model: str) -> dict[str, str]:
    return {names.LABEL_ROUTER: model, names.LABEL_MANAGED_BY: names.MANAGED_BY,
            names.LABEL_APP_NAME: "shardwise-router", names.LABEL_APP_INSTANCE: model}


def _meta(model: ShardedModel) -> dict:
    return {"name": names.router_name(model.name), "namespace": model.namespace,
            "labels": labels(model.name), "ownerReferences": [owner_reference(model)]}


def ready_addresses(pods: Iterable[Mapping[str, Any]], port: int) -> list[str]:
    """`http://<podIP>:<port>` of each Ready stage-0 worker pod that is not being deleted, sorted
    (the file's content changes only when the set does)."""
    out = set()
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if (meta.get("labels") or {}).get(names.LABEL_STAGE) != "0" or meta.get("deletionTimestamp"):
            continue
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ip and ready:
            out.add(f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}")
    return sorted(out)


def render_replicas_configmap(model: ShardedModel, addresses: list[str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(model),
            "data": {REPLICAS_FILE: "".join(a + "\n" for a in addresses)}}


def replicas_digest(objs: Iterable[Mapping[str, Any]]) -> str:
    """A short digest of the replicas file among render()'s objects (ANNOTATION_ROUTER_REPLICAS)."""
    data = next(o["data"][REPLICAS_FILE] for o in objs if o["kind"] == "ConfigMap")
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def _args(model: ShardedModel) -> list[str]:
    router, port = model.spec.serving.router, model.spec.serving.port
    assert router is not None
    # no --host: the router listens where a worker pod does (names.bind_address of its POD_IP), so the
    # Service, the probe and `kubectl port-forward` (localhost inside the pod) all reach it
    args = ["--replicas-file", REPLICAS_PATH, "--port", str(port)]
    if _api_keys(model):
        args += ["--api-key-file", names.API_KEYS_PATH]
    if router.rate_limit:
        args += ["--rate-limit", router.rate_limit]
    hold = hold_seconds(router, model.spec.autoscaling)
    if hold is not None:
        args += ["--hold-seconds", f"{hold:g}"]
    return args


def _volumes(model: ShardedModel) -> tuple[list[dict], list[dict]]:
    """The replicas file, and the model's API keys mounted where the workers have them."""
    volumes = [{"name": "replicas", "configMap": {"name": names.router_name(model.name)}}]
    mounts = [{"name": "replicas", "mountPath": REPLICAS_MOUNT, "readOnly": True}]
    if _api_keys(model):
        ref = model.spec.serving.auth.secret_ref
        volumes.append({"name": "api-keys", "secret": {"secretName": ref.name, "defaultMode": 0o444,
                                                       "items": [{"key": ref.key, "path": "keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": names.API_KEYS_MOUNT, "readOnly": True})
    return volumes, mounts


def _pod_spec(model: ShardedModel, image: str) -> dict:
    port = model.spec.serving.port
    volumes, mounts = _volumes(model)
    container = {
        "name": "router", "image": image, "command": ["shardwise", "router"], "args": _args(model),
        "env": [{"name": names.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # Ready whether or not a replica is: the router holds requests while none is
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 2, "failureThreshold": 3},
        "resources": RESOURCES, "volumeMounts": mounts,
        "securityContext": {**WORKER_CONTAINER_SECURITY, "readOnlyRootFilesystem": True},
    }
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes, "enableServiceLinks": False,
                            "automountServiceAccountToken": False, "terminationGracePeriodSeconds": GRACE_SECONDS,
                            "securityContext": WORKER_POD_SECURITY}
    # the model's placement keeps its front door in the same pool of nodes
    placement = model.spec.placement
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = [t.to_api() for t in placement.tolerations]
    return spec


def render_deployment(model: ShardedModel, settings: Settings | None = None) -> dict:
    router = model.spec.serving.router
    assert router is not None
    image = (settings or current()).router_image
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(model),
            "spec": {"replicas": router.replicas, "selector": {"matchLabels": {names.LABEL_ROUTER: model.name}},
                     # one router pod at a time, the others keep serving
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": labels(model.name)}, "spec": _pod_spec(model, image)}}}


def render_network_policy(model: ShardedModel, settings: Settings | None = None) -> dict:
    """The router pods hear their port only, from spec.serving.allowFrom's peers (anyone when empty)
    and from the operator's own pods (it reads a router's /metrics to wake a model scaled to zero)."""
    serving: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": model.spec.serving.port}]}
    if model.spec.serving.allow_from:
        serving["from"] = netpolicy.allowed(model.spec.serving.allow_from, settings or current())
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(model),
            "spec": {"podSelector": {"matchLabels": {names.LABEL_ROUTER: model.name}},
                     "policyTypes": ["Ingress"], "ingress": [serving]}}


def render(model: ShardedModel, pods: Iterable[Mapping[str, Any]], settings: Settings | None = None) -> list[dict]:
    """The router's objects, the policy first (no router pod runs before it), the replicas file
    before the pods that read it; [] when the model runs no router."""
    if not router_enabled(model):
        return []
    settings = settings or current()
    policy = [render_network_policy(model, settings)] if settings.network_policy else []
    addresses = ready_addresses(pods, model.spec.serving.port)
    return policy + [render_replicas_configmap(model, addresses), render_deployment(model, settings)]


ROUTER_KINDS = ("NetworkPolicy", "ConfigMap", "Deployment")   # what render() makes, all named router_name
