"""The node heartbeat: each served node's Lease renewed in kube-node-lease and its Ready condition
written, as a kubelet does, so that the node lifecycle controller sees it alive."""
from __future__ import annotations

import os
import time

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes.timestamps import micro_now, now

LEASE_SECONDS = 20
RENEW_EVERY = 4.0
STATUS_EVERY = 10.0
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


class Heartbeat:
    """When each served node last renewed its Lease and last posted its status."""

    def __init__(self, client: kapi.Client, renew_every: float = RENEW_EVERY):
        self.client = client
        self.renew_every = renew_every
        self.last_status: dict[str, float] = {}
        self.last_lease: dict[str, float] = {}

    def forget(self, name: str) -> None:
        """The node is no longer served: post its status at once should it come back."""
        self.last_status.pop(name, None)

    def beat(self, alive: dict[str, dict], came: set[str]) -> None:
        """Renew the Lease and post the status of each node in `alive` that is due (new ones now)."""
        for name in alive:
            t = time.monotonic()
            if t - self.last_lease.get(name, 0) >= self.renew_every:
                self.renew_lease(name)
                self.last_lease[name] = t
            if t - self.last_status.get(name, 0) >= STATUS_EVERY or name in came:
                self.post_status(alive[name])
                self.last_status[name] = t

    def renew_lease(self, name: str) -> None:
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": micro_now()}
        try:
            self.client.merge_patch(f"{LEASES}/{name}", {"spec": spec})
        except kapi.ApiError as e:
            if e.status != 404:
                raise
            self.client.create(LEASES, {"metadata": {"name": name, "namespace": "kube-node-lease"},
                                        "spec": spec})

    def post_status(self, node: dict) -> None:
        t = now()
        name = node["metadata"]["name"]

        def cond(type_: str, status: str, reason: str, message: str) -> dict:
            return {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": t, "lastTransitionTime": t}
        previous = {c["type"]: c for c in node.get("status", {}).get("conditions") or []}
        conditions = [cond("Ready", "True", "KubeletReady", "local node runtime is serving"),
                      cond("MemoryPressure", "False", "KubeletHasSufficientMemory", ""),
                      cond("DiskPressure", "False", "KubeletHasNoDiskPressure", ""),
                      cond("PIDPressure", "False", "KubeletHasSufficientPID", "")]
        for c in conditions:  # keep transition times unless the status really changes
            old = previous.get(c["type"])
            if old and old.get("status") == c["status"] and old.get("lastTransitionTime"):
                c["lastTransitionTime"] = old["lastTransitionTime"]
        self.client.strategic_patch(f"/api/v1/nodes/{name}/status", {"status": {
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "shardwise-local", "containerRuntimeVersion":
                         "shardwise-local://processes", "operatingSystem": "linux",
                         "architecture": "amd64", "kernelVersion": os.uname().release,
                         "osImage": "local processes", "kubeProxyVersion": "",
                         "machineID": "", "systemUUID": "", "bootID": ""},
            "phase": "Running"}})
