"""Name resolution in place of cluster DNS: a pod's or a Service's name to a pod IP.

`<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` is the IP of the pod with that hostname and
subdomain; `<service>.<namespace>.svc[.cluster.local]` the IP of a Ready pod behind that Service.
"""
from __future__ import annotations

import re

from shardwise.e2e.localcluster import kapi

DNS_NAME = re.compile(r"(?<![\w.-])((?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.){2,3}svc)"
                      r"(?:\.cluster\.local)?(?![\w-])")


def is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def resolve(name: str, pods: list[dict], client: kapi.Client) -> str | None:
    """The IP behind `name` (a DNS_NAME match without .cluster.local), or None while there is none."""
    labels = name.split(".")[:-1]  # drop "svc"
    if len(labels) == 3:
        return _pod_ip(*labels, pods)
    svc_name, ns = labels
    try:
        svc = client.get(f"/api/v1/namespaces/{ns}/services/{svc_name}")
    except kapi.ApiError:
        return None
    selector = svc["spec"].get("selector") or {}
    if not selector:
        return None
    for p in pods:
        meta = p["metadata"]
        if meta["namespace"] != ns or meta.get("deletionTimestamp"):
            continue
        if all(meta.get("labels", {}).get(k) == v for k, v in selector.items()) and \
                is_ready(p) and p.get("status", {}).get("podIP"):
            return p["status"]["podIP"]
    return None


def _pod_ip(host: str, sub: str, ns: str, pods: list[dict]) -> str | None:
    for p in pods:
        spec, meta = p["spec"], p["metadata"]
        if (meta["namespace"] == ns and spec.get("subdomain") == sub
                and (spec.get("hostname") or meta["name"]) == host
                and not meta.get("deletionTimestamp") and p.get("status", {}).get("podIP")):
            return p["status"]["podIP"]
    return None
