"""The status a pod reports: phase, conditions (transition times kept while unchanged), the states
of its containers and init containers, its IPs."""
from __future__ import annotations

from shardwise.e2e.localcluster.localnodes.containers import ContainerProc
from shardwise.e2e.localcluster.localnodes.timestamps import now


def pod_status(pod: dict, containers: list[ContainerProc], inits: list[ContainerProc], ip: str,
               start_time: str) -> dict:
    statuses = [_container_status(c) for c in containers]
    init_statuses = [{"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                      "ready": bool(c.terminated and c.terminated["exitCode"] == 0),
                      "restartCount": c.restarts, "state": c.state()} for c in inits]
    initialized = all(c.terminated and c.terminated["exitCode"] == 0 for c in inits)
    phase = _phase(containers)
    ready = phase == "Running" and all(s["ready"] for s in statuses)
    previous = {c["type"]: c for c in pod.get("status", {}).get("conditions") or []}
    status = {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}],
              "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
              "startTime": start_time, "conditions": _conditions(previous, initialized, ready),
              "containerStatuses": statuses}
    if init_statuses:
        status["initContainerStatuses"] = init_statuses
    return status


def _container_status(c: ContainerProc) -> dict:
    s = {"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
         "ready": c.ready and c.proc is not None, "restartCount": c.restarts,
         "started": c.running(), "state": c.state()}
    if c.proc is not None:
        s["containerID"] = f"local://{c.proc.pid}"
    if c.last_terminated:
        s["lastState"] = {"terminated": c.last_terminated}
    return s


def _phase(containers: list[ContainerProc]) -> str:
    if all(c.terminated for c in containers):
        return "Succeeded" if all(c.terminated["exitCode"] == 0 for c in containers) else "Failed"
    if any(c.proc is not None or c.restarts or c.terminated for c in containers):
        return "Running"
    return "Pending"


def _conditions(previous: dict[str, dict], initialized: bool, ready: bool) -> list[dict]:
    t = now()

    def cond(type_: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        old = previous.get(type_)
        since = old["lastTransitionTime"] if old and old.get("status") == status and \
            old.get("lastTransitionTime") else t
        return {"type": type_, "status": status, "lastTransitionTime": since,
                "lastProbeTime": None}
    return [cond("PodReadyToStartContainers", True), cond("Initialized", initialized),
            cond("ContainersReady", ready), cond("Ready", ready), cond("PodScheduled", True)]
