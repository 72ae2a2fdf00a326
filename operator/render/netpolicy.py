"""The NetworkPolicy of one model, pure: who may open a connection to its pods.

    - every port, from the model's own pods: the rendezvous (torch's TCPStore on MASTER_PORT) and
      the collectives (gloo and NCCL listen on ephemeral ports, so no port list would do), which
      exchange pickles and must hear no one else;
    - the serving port, from anywhere, or, when spec.serving.allowFrom names peers, from those and
      from the operator's own pods (it reads a training pod's /progress and, for autoscaling, a
      serving pod's /metrics there); with spec.serving.router enabled, from the model's router pods
      and the operator's only (allowFrom then applies to the router's own policy, render/router.py).

Ingress only: what the pods may reach is left alone. The policy selects the pods by the model's
label; it is owned by the model like every object it makes (garbage-collected with it). Whether it
is enforced is the cluster's network plugin's business (docs/security.md).
"""
from __future__ import annotations

from typing import Any, Iterable

from shardwise.crds import names
from shardwise.crds.models import LabelSelector, NetworkPeer, ShardedModel
from shardwise.operator.render.settings import Settings

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"   # set by the API server on every namespace


def _selector(selector: LabelSelector) -> dict:
    return {"matchLabels": dict(selector.match_labels)} if selector.match_labels else {}


def _peer(peer: NetworkPeer) -> dict:
    out: dict[str, Any] = {}
    if peer.namespace_selector is not None:
        out["namespaceSelector"] = _selector(peer.namespace_selector)
    if peer.pod_selector is not None:
        out["podSelector"] = _selector(peer.pod_selector)
    return out


def operator_peer(settings: Settings) -> dict | None:
    """The operator's pods as a peer; None when it runs outside the cluster (nothing to name)."""
    if not settings.operator_namespace:
        return None
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}}}
    peer["podSelector"] = {"matchLabels": dict(settings.operator_labels)} if settings.operator_labels else {}
    return peer


def allowed(peers: Iterable[NetworkPeer], settings: Settings) -> list[dict]:
    """spec.serving.allowFrom's peers as NetworkPolicy peers, and the operator's pods with them (it
    reads what the pods serve: /metrics, /progress)."""
    operator = operator_peer(settings)
    return [_peer(p) for p in peers] + ([operator] if operator else [])


def router_peer(model: str) -> dict:
    """The model's router pods (same namespace)."""
    return {"podSelector": {"matchLabels": {names.LABEL_ROUTER: model}}}


def render(model: ShardedModel, meta: dict, settings: Settings) -> dict:
    """The model's NetworkPolicy; `meta`: its metadata (name, namespace, labels, ownerReferences)."""
    own = {"podSelector": {"matchLabels": {names.LABEL_MODEL: model.name}}}
    serving: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": model.spec.serving.port}]}
    allow = model.spec.serving.allow_from
    operator = operator_peer(settings)
    router = model.spec.serving.router
    if router is not None and router.enabled:
        # the router's pods stand in front: allowFrom is their policy's (render/router.py), and
        # the workers' serving port hears only them and the operator
        serving["from"] = [router_peer(model.name)] + ([operator] if operator else [])
    elif allow:
        serving["from"] = allowed(allow, settings)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": {names.LABEL_MODEL: model.name}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [own]}, serving]}}
