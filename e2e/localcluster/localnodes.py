"""Local nodes: Node objects whose pods run as processes on this machine.

A development runtime, not a kubelet. It lets the operator and the real worker run together on one
machine without containers. One process (started by `shardwise dev up --local-nodes K`) serves every
Node labelled `shardwise.dev/local-node=true` that is not labelled `shardwise.dev/node-down=true`:

- keeps the node alive: renews its Lease in kube-node-lease and writes its Ready condition;
- for each pod bound to it: gives the pod its own loopback IP (status.podIP, env POD_IP), writes its
  ConfigMap/Secret volumes into a per-pod folder, and runs each container's command + args as a
  process (own process group) with the container's env; stdout/stderr go to
  <state>/pods/<namespace>_<pod>/<container>.log;
- reports phase, container states, restartCount and readiness (the container's readinessProbe:
  httpGet, tcpSocket or exec) to the API server; restarts exited containers per restartPolicy;
  livenessProbe failures restart the container;
- kills a pod's processes when the pod is deleted (SIGTERM, then SIGKILL after the grace period),
  when its node is deleted or marked down, and when this runtime stops.

What a container sees, since there is no image and no mount namespace:
- mountPath of a volume is rewritten to the materialised folder wherever it appears in command, args,
  env values and the files of ConfigMap volumes (`/etc/shardwise/plan.json` ->
  `<state>/pods/ns_pod/volumes/plan/plan.json`; the worker's pod contract in that file names the
  model, data and checkpoint paths inside the pod);
  a pod's own hostPath volume is a folder of its node, <state>/nodes/<node>/hostpath/<path> (made
  for any type but File/Socket/CharDevice/BlockDevice), so node-local storage is local to the node:
  pods on other nodes do not see it, a pod on the same node later does, and deleting the Node
  deletes that folder (its disk is gone; a node marked down keeps it, as a rebooted one would);
  a PersistentVolumeClaim bound to a hostPath or local PersistentVolume is that folder of this
  machine (shared by every pod on every node that mounts it, as a ReadWriteMany volume is);
- the terminationMessagePath (default /dev/termination-log) is rewritten the same way to a file of
  the container's own (in a ConfigMap's files: of the pod's first container declaring that path);
  what the process writes there (or, with FallbackToLogsOnError, the tail of
  its log when it failed) is reported as the terminated state's message;
- there is no cluster DNS: `<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` in args and env
  values is rewritten to the IP of the pod with that hostname and subdomain, and
  `<service>.<namespace>.svc[.cluster.local]` to the IP of a Ready pod behind that Service; the
  container starts only once every such name resolves (as a real pod would retry DNS);
- the environment is the runtime's own (PATH, HOME, ...) plus the container's env.
Not done: images, resource limits (no cgroups), network isolation (ports are shared; bind to
POD_IP), startupProbe, exec/logs/port-forward through the API, emptyDir size limits, claims bound
to other kinds of volume, readOnly mounts (nothing stops a process writing there).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from shardwise.e2e.localcluster import kapi

LOCAL_NODE_LABEL = "shardwise.dev/local-node"
NODE_DOWN_LABEL = "shardwise.dev/node-down"
LEASE_SECONDS = 20
RENEW_EVERY = 4.0
STATUS_EVERY = 10.0
MAX_BACKOFF = 10.0  # restart back-off cap in seconds (a kubelet's is 5 minutes)
TERMINATION_LOG = "/dev/termination-log"
MESSAGE_BYTES = 4096        # a kubelet keeps at most this much of a termination message
FALLBACK_LOG_LINES = 80     # ... and of the log's tail in its place (FallbackToLogsOnError)

log = logging.getLogger("shardwise.localnodes")
DNS_NAME = re.compile(r"(?<![\w.-])((?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.){2,3}svc)"
                      r"(?:\.cluster\.local)?(?![\w-])")


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------- pod IPs

class IPPool:
    """Loopback addresses for pods, 127.X.Y.1-254 with X.Y taken from the state folder, so that two
    local clusters on one machine rarely share addresses."""

    def __init__(self, seed: str):
        digest = hashlib.sha256(seed.encode()).digest()
        self.base = (digest[0] % 250 + 2, digest[1])
        self.used: set[str] = set()
        self.lock = threading.Lock()

    def take(self, wanted: str | None = None) -> str:
        """A free address; `wanted` (the pod's earlier IP, after a runtime or node restart) if free."""
        with self.lock:
            if wanted and wanted.startswith("127.") and wanted != "127.0.0.1" \
                    and wanted not in self.used:
                self.used.add(wanted)
                return wanted
            x, y = self.base
            for i in range(254 * 16):
                ip = f"127.{x}.{(y + i // 254) % 256}.{i % 254 + 1}"
                if ip not in self.used:
                    self.used.add(ip)
                    return ip
        raise RuntimeError("no free loopback address for a pod")

    def give_back(self, ip: str) -> None:
        with self.lock:
            self.used.discard(ip)


# ---------------------------------------------------------------- the runtime

class Runtime:
    def __init__(self, client: kapi.Client, state_dir: Path, nodes: list[dict]):
        self.client = client
        self.dir = state_dir
        self.initial_nodes = nodes
        self.ips = IPPool(str(state_dir))
        self.lock = threading.RLock()
        self.managed: dict[str, dict] = {}  # node name -> Node object
        self.known: set[str] = set()         # every local node seen, down ones included
        self.pods: dict[str, dict] = {}  # uid -> last seen pod (all pods, for name resolution)
        self.runners: dict[str, PodRunner] = {}
        self.stopping = threading.Event()
        self.synced = threading.Event()

    # nodes
    def register_nodes(self) -> None:
        for manifest in self.initial_nodes:
            try:
                self.client.create("/api/v1/nodes", manifest)
            except kapi.ApiError as e:
                if e.status != 409:
                    raise

    def node_loop(self) -> None:
        last_status: dict[str, float] = {}
        last_lease: dict[str, float] = {}
        while not self.stopping.is_set():
            try:
                items = self.client.get("/api/v1/nodes",
                                        labelSelector=f"{LOCAL_NODE_LABEL}=true")["items"]
                alive = {n["metadata"]["name"]: n for n in items
                         if n["metadata"].get("labels", {}).get(NODE_DOWN_LABEL) != "true"
                         and not n["metadata"].get("deletionTimestamp")}
                present = {n["metadata"]["name"] for n in items if not n["metadata"].get("deletionTimestamp")}
                with self.lock:
                    gone = set(self.managed) - set(alive)
                    came = set(alive) - set(self.managed)
                    deleted = self.known - present
                    self.managed, self.known = alive, present | set(alive)
                for name in gone:
                    log.info("node %s is down or deleted: stopping its pods", name)
                    last_status.pop(name, None)
                    self.drop_node(name)
                for name in deleted:
                    self.wipe_node(name)
                for name in alive:
                    t = time.monotonic()
                    if t - last_lease.get(name, 0) >= RENEW_EVERY:
                        self.renew_lease(name)
                        last_lease[name] = t
                    if t - last_status.get(name, 0) >= STATUS_EVERY or name in came:
                        self.post_node_status(alive[name])
                        last_status[name] = t
                for name in came:
                    log.info("serving node %s", name)
                    self.resync_node(name)
            except Exception as e:  # the API server may restart; keep trying
                log.warning("node loop: %s", e)
            self.stopping.wait(1.0)

    def renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": micro_now()}
        try:
            self.client.merge_patch(path, {"spec": spec})
        except kapi.ApiError as e:
            if e.status != 404:
                raise
            self.client.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                               {"metadata": {"name": name, "namespace": "kube-node-lease"},
                                "spec": spec})

    def post_node_status(self, node: dict) -> None:
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

    def drop_node(self, name: str) -> None:
        with self.lock:
            victims = [r for r in self.runners.values() if r.node == name]
        for runner in victims:
            runner.stop(grace=0, report=False)

    def node_folder(self, name: str) -> Path:
        """The node's own disk: where its pods' hostPath volumes are."""
        return self.dir.parent / "nodes" / name

    def host_path(self, node: str, volume: dict) -> Path:
        """A hostPath volume of a pod on `node`: <state>/nodes/<node>/hostpath/<path>."""
        source = volume["hostPath"]
        folder = self.node_folder(node) / "hostpath" / source["path"].lstrip("/")
        if source.get("type") not in ("File", "Socket", "CharDevice", "BlockDevice"):
            folder.mkdir(parents=True, exist_ok=True)
        return folder

    def wipe_node(self, name: str) -> None:
        """A deleted node's disk is gone: its hostPath folders with it."""
        folder = self.node_folder(name)
        if folder.exists():
            log.info("node %s is deleted: removing its disk %s", name, folder)
            shutil.rmtree(folder, ignore_errors=True)

    def resync_node(self, name: str) -> None:
        with self.lock:
            pods = [p for p in self.pods.values() if p["spec"].get("nodeName") == name]
        for pod in pods:
            self.sync_pod(pod)

    # pods
    def pod_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.client.get("/api/v1/pods")
                seen = {p["metadata"]["uid"]: p for p in listing["items"]}
                with self.lock:
                    vanished = set(self.pods) - set(seen)
                    self.pods = seen
                for uid in vanished:
                    self.forget_pod(uid)
                for pod in seen.values():
                    self.sync_pod(pod)
                self.synced.set()
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    for event in self.client.watch("/api/v1/pods", rv, timeout_seconds=60):
                        kind, obj = event["type"], event["object"]
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if kind == "ERROR":
                            raise kapi.ApiError(obj.get("code", 500), "watch", json.dumps(obj))
                        if kind == "BOOKMARK":
                            continue
                        uid = obj["metadata"]["uid"]
                        if kind == "DELETED":
                            with self.lock:
                                self.pods.pop(uid, None)
                            self.forget_pod(uid)
                        else:
                            with self.lock:
                                self.pods[uid] = obj
                            self.sync_pod(obj)
            except Exception as e:
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; listing again", e)
                    self.stopping.wait(1.0)

    def sync_pod(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            runner = self.runners.get(uid)
            on_us = pod["spec"].get("nodeName") in self.managed
            if runner is None:
                if not on_us or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                runner = PodRunner(self, pod)
                self.runners[uid] = runner
                runner.start()
                return
        runner.update(pod)

    def forget_pod(self, uid: str) -> None:
        with self.lock:
            runner = self.runners.get(uid)
        if runner:
            runner.stop(grace=0, report=False)

    def runner_done(self, runner: "PodRunner") -> None:
        with self.lock:
            if self.runners.get(runner.uid) is runner:
                del self.runners[runner.uid]

    # name resolution (there is no cluster DNS)
    def resolve(self, name: str) -> str | None:
        labels = name.split(".")[:-1]  # drop "svc"
        with self.lock:
            pods = list(self.pods.values())
        if len(labels) == 3:
            host, sub, ns = labels
            for p in pods:
                spec, meta = p["spec"], p["metadata"]
                if (meta["namespace"] == ns and spec.get("subdomain") == sub
                        and (spec.get("hostname") or meta["name"]) == host
                        and not meta.get("deletionTimestamp") and p.get("status", {}).get("podIP")):
                    return p["status"]["podIP"]
            return None
        svc_name, ns = labels
        try:
            svc = self.client.get(f"/api/v1/namespaces/{ns}/services/{svc_name}")
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
                    _is_ready(p) and p.get("status", {}).get("podIP"):
                return p["status"]["podIP"]
        return None

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
        for runner in runners:
            runner.stop(grace=2, report=False)


def _is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


# ---------------------------------------------------------------- one pod

class ContainerProc:
    """One container: its process, restarts and probe state."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.name = spec["name"]
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.restarts = 0
        self.ready = False
        self.last_terminated: dict | None = None
        self.terminated: dict | None = None
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.next_start = 0.0
        self.probe_due = 0.0
        self.live_due = 0.0
        self.ready_ok = 0
        self.ready_fail = 0
        self.live_fail = 0

    def state(self) -> dict:
        if self.proc is not None and self.proc.poll() is None:
            return {"running": {"startedAt": self.started_at}}
        if self.terminated:
            return {"terminated": self.terminated}
        reason, message = self.waiting or ("ContainerCreating", "")
        return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


class PodRunner(threading.Thread):
    def __init__(self, runtime: Runtime, pod: dict):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.rt = runtime
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.node = pod["spec"]["nodeName"]
        self.ns, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.dir = runtime.dir / f"{self.ns}_{self.name}"
        self.ip = runtime.ips.take(pod.get("status", {}).get("podIP"))
        self.containers = [ContainerProc(c) for c in pod["spec"]["containers"]]
        self.inits = [ContainerProc(c) for c in pod["spec"].get("initContainers") or []]
        self.start_time = now()
        self.halt = threading.Event()
        self.report = True
        self.kill_grace = 0.0
        self.last_status: str | None = None
        self.lock = threading.Lock()
        self.container_paths: dict[str, str] = {}   # the launching container's own paths

    def update(self, pod: dict) -> None:
        with self.lock:
            self.pod = pod

    def stop(self, grace: float, report: bool) -> None:
        self.report = report
        self.kill_grace = grace
        self.halt.set()

    # main loop
    def run(self) -> None:
        try:
            self._run()
        except Exception as e:
            log.exception("pod %s/%s: %s", self.ns, self.name, e)
        finally:
            self._kill_all(self.kill_grace)
            self.rt.ips.give_back(self.ip)
            self.rt.runner_done(self)

    def _run(self) -> None:
        restart = self.pod["spec"].get("restartPolicy", "Always")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mounts = {}
        self._report()
        while not self.halt.is_set():
            try:
                if self._step(restart):
                    return
            except Exception as e:  # an API hiccup must not orphan the pod's processes
                log.warning("pod %s/%s: %s", self.ns, self.name, e)
                self.halt.wait(1.0)

    def _step(self, restart: str) -> bool:
        """One pass over the pod; True when the pod is gone and the runner should end."""
        with self.lock:
            pod = self.pod
        if pod["metadata"].get("deletionTimestamp"):
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            self._kill_all(30 if grace is None else min(float(grace), 30))
            self._report()
            try:  # what a kubelet does once the containers are gone
                self.rt.client.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                                      {"gracePeriodSeconds": 0,
                                       "preconditions": {"uid": self.uid}})
            except kapi.ApiError as e:
                if e.status not in (404, 409):
                    log.warning("deleting %s/%s: %s", self.ns, self.name, e)
            return True
        if not self.mounts:
            try:
                self.mounts = self._materialise_volumes(pod)
            except _Waiting as w:
                for c in self.containers:
                    c.waiting = (w.reason, w.message)
                self._report()
                self.halt.wait(1.0)
                return False
        if not self._run_inits(restart):
            self._report()
            self.halt.wait(0.5)
            return False
        for c in self.containers:
            self._tend(c, restart)
        self._report()
        if self._finished(restart):
            self._report()
            # keep watching for deletion, but there is nothing left to run
            while not self.halt.is_set() and not self.pod["metadata"].get("deletionTimestamp"):
                self.halt.wait(0.5)
            return False
        self.halt.wait(0.25)
        return False

    def _run_inits(self, restart: str) -> bool:
        for c in self.inits:
            if c.terminated and c.terminated.get("exitCode") == 0:
                continue
            if c.proc is None or c.proc.poll() is not None:
                if c.proc is not None:
                    code = c.proc.returncode
                    c.terminated = {"exitCode": code, "reason": "Completed" if code == 0 else
                                    "Error", "startedAt": c.started_at, "finishedAt": now()}
                    c.proc = None
                    if code == 0:
                        continue
                    if restart == "Never":
                        return False
                    c.restarts += 1
                    c.next_start = time.monotonic() + min(MAX_BACKOFF, 0.5 * 2 ** c.restarts)
                if time.monotonic() >= c.next_start:
                    self._launch(c)
            return False
        return True

    def _tend(self, c: ContainerProc, restart: str) -> None:
        t = time.monotonic()
        if c.proc is not None and c.proc.poll() is not None:
            code = c.proc.returncode
            info = {"exitCode": code if code >= 0 else 128 - code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": c.started_at, "finishedAt": now(),
                    **self._termination_message(c, code)}
            c.proc = None
            c.ready = False
            c.ready_ok = c.ready_fail = c.live_fail = 0
            if restart == "Always" or (restart == "OnFailure" and code != 0):
                c.last_terminated = info
                c.restarts += 1
                c.next_start = t + min(MAX_BACKOFF, 0.5 * 2 ** (c.restarts - 1))
                c.waiting = ("CrashLoopBackOff", f"back-off restarting container {c.name}")
                log.info("pod %s/%s container %s exited %s; restart %d", self.ns, self.name,
                         c.name, code, c.restarts)
            else:
                c.terminated = info
        if c.proc is None and c.terminated is None and t >= c.next_start:
            self._launch(c)
        if c.proc is not None and c.proc.poll() is None:
            self._probe(c, t)

    def _finished(self, restart: str) -> bool:
        return all(c.terminated is not None for c in self.containers)

    # probes
    def _probe(self, c: ContainerProc, t: float) -> None:
        readiness = c.spec.get("readinessProbe")
        if readiness is None:
            c.ready = True
        elif t >= c.probe_due:
            c.probe_due = t + readiness.get("periodSeconds", 10)
            if self._check(c, readiness):
                c.ready_ok += 1
                c.ready_fail = 0
                if c.ready_ok >= readiness.get("successThreshold", 1):
                    c.ready = True
            else:
                c.ready_fail += 1
                c.ready_ok = 0
                if c.ready_fail >= readiness.get("failureThreshold", 3) or not c.ready:
                    c.ready = False
        liveness = c.spec.get("livenessProbe")
        if liveness is not None and t >= c.live_due:
            c.live_due = t + liveness.get("periodSeconds", 10)
            if self._check(c, liveness):
                c.live_fail = 0
            else:
                c.live_fail += 1
                if c.live_fail >= liveness.get("failureThreshold", 3):
                    log.info("pod %s/%s container %s failed its liveness probe; killing",
                             self.ns, self.name, c.name)
                    self._kill(c, grace=float(self.pod["spec"].get(
                        "terminationGracePeriodSeconds", 30) or 0))

    def _check(self, c: ContainerProc, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        if "httpGet" in probe:
            http = probe["httpGet"]
            port = self._port(c, http.get("port"))
            scheme = (http.get("scheme") or "HTTP").lower()
            host = http.get("host") or self.ip
            url = f"{scheme}://{host}:{port}{http.get('path', '/')}"
            try:
                req = urllib.request.Request(url, headers={
                    h["name"]: h["value"] for h in http.get("httpHeaders") or []})
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            except Exception:
                return False
        if "tcpSocket" in probe:
            port = self._port(c, probe["tcpSocket"].get("port"))
            try:
                with socket.create_connection((probe["tcpSocket"].get("host") or self.ip, port),
                                              timeout=timeout):
                    return True
            except OSError:
                return False
        if "exec" in probe:
            try:
                env = self._env(c.spec)
                return subprocess.run(self._rewrite_list(probe["exec"]["command"], env), env=env,
                                      timeout=max(1, timeout), capture_output=True,
                                      cwd=self.dir).returncode == 0
            except (OSError, subprocess.TimeoutExpired, _Waiting, kapi.ApiError):
                return False
        return True

    @staticmethod
    def _port(c: ContainerProc, port) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        return 0

    # processes
    def _launch(self, c: ContainerProc) -> None:
        command = list(c.spec.get("command") or []) + list(c.spec.get("args") or [])
        if not c.spec.get("command"):
            c.waiting = ("CreateContainerError",
                         "local nodes run only containers with a command (there is no image)")
            c.next_start = time.monotonic() + 3600
            return
        message_file = self._message_file(c)
        message_file.write_bytes(b"")
        self.container_paths = {c.spec.get("terminationMessagePath") or TERMINATION_LOG: str(message_file)}
        try:
            env = self._env(c.spec)
            command = self._rewrite_list(command, env)
        except _Waiting as w:
            c.waiting = (w.reason, w.message)
            c.next_start = time.monotonic() + 0.5
            return
        finally:
            self.container_paths = {}
        cwd = c.spec.get("workingDir")
        cwd = self._rewrite(cwd, env) if cwd else str(self.dir)
        if not os.path.isdir(cwd):
            cwd = str(self.dir)
        out = open(self.dir / f"{c.name}.log", "ab")
        out.write(f"--- {now()} start {command!r}\n".encode())
        out.flush()
        try:
            c.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            c.waiting = ("RunContainerError", f"{type(e).__name__}: {e}")
            c.last_terminated = {"exitCode": 128, "reason": "StartError", "message": str(e),
                                 "finishedAt": now()}
            c.restarts += 1
            c.next_start = time.monotonic() + min(MAX_BACKOFF, 0.5 * 2 ** c.restarts)
            return
        finally:
            out.close()
        c.started_at = now()
        c.waiting = None
        delay = (c.spec.get("readinessProbe") or {}).get("initialDelaySeconds", 0)
        c.probe_due = time.monotonic() + delay
        c.live_due = time.monotonic() + (c.spec.get("livenessProbe") or {}).get(
            "initialDelaySeconds", 0)

    def _kill(self, c: ContainerProc, grace: float) -> None:
        proc = c.proc
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()

    def _kill_all(self, grace: float) -> None:
        procs = [c for c in self.inits + self.containers if c.proc is not None]
        for c in procs:
            if c.proc.poll() is None:
                _signal_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in procs:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
            if c.terminated is None:
                c.terminated = {"exitCode": 137 if c.proc.returncode < 0 else c.proc.returncode,
                                "reason": "Killed" if c.proc.returncode < 0 else "Completed",
                                "startedAt": c.started_at, "finishedAt": now(),
                                **self._termination_message(c, c.proc.returncode)}
            c.proc = None
            c.ready = False

    def _message_file(self, c: ContainerProc) -> Path:
        return self.dir / f"{c.name}.termination-log"

    def _termination_message(self, c: ContainerProc, code: int) -> dict:
        """{"message": ...} as a kubelet reports it: the file the container wrote, else (policy
        FallbackToLogsOnError, the container failed) the tail of its log; {} when there is none."""
        try:
            text = self._message_file(c).read_bytes()[:MESSAGE_BYTES].decode(errors="replace")
        except OSError:
            text = ""
        if not text.strip() and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                lines = (self.dir / f"{c.name}.log").read_bytes().decode(errors="replace").splitlines()
            except OSError:
                lines = []
            text = "\n".join(lines[-FALLBACK_LOG_LINES:])[-MESSAGE_BYTES // 2:]
        return {"message": text} if text.strip() else {}

    # env, volumes, name rewriting
    def _env(self, spec: dict) -> dict[str, str]:
        pod = self.pod
        env = dict(os.environ)
        env.pop("KUBECONFIG", None)
        env["HOSTNAME"] = pod["spec"].get("hostname") or pod["metadata"]["name"]
        env["POD_IP"] = self.ip
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self._object_data("configmaps", source["configMapRef"]["name"],
                                         source["configMapRef"].get("optional"))
            else:
                data = self._object_data("secrets", source["secretRef"]["name"],
                                         source["secretRef"].get("optional"), decode=True)
            env.update({prefix + k: v for k, v in data.items()})
        declared: dict[str, str] = {}
        for item in spec.get("env") or []:
            value = self._env_value(item, declared, spec)
            if value is not None:
                declared[item["name"]] = value
        env.update(declared)
        for key in list(declared):
            env[key] = self._rewrite(env[key], env)
        return env

    def _env_value(self, item: dict, declared: dict, spec: dict) -> str | None:
        if "value" in item:
            # $(VAR) refers to variables declared before it, $$ escapes
            return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                          lambda m: "$" if m.group(0) == "$$" else
                          declared.get(m.group(1), m.group(0)), item["value"])
        source = item.get("valueFrom") or {}
        if "fieldRef" in source:
            return self._field(source["fieldRef"]["fieldPath"])
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self._object_data("configmaps", ref["name"], ref.get("optional")).get(ref["key"])
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self._object_data("secrets", ref["name"], ref.get("optional"),
                                     decode=True).get(ref["key"])
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, _, res = ref["resource"].partition(".")
            return str((spec.get("resources") or {}).get(kind, {}).get(res, "0"))
        return None

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(path[9:]) or {}).items()))
        return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
                "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                "status.hostIPs": "127.0.0.1"}.get(path, "")

    def _object_data(self, kind: str, name: str, optional, decode: bool = False) -> dict:
        obj = self._get_or_wait(f"/api/v1/namespaces/{self.ns}/{kind}/{name}", f"{kind[:-1]} {name!r} not found",
                                optional)
        data = dict(obj.get("data") or {})
        if decode:
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v).decode(errors="replace")
        return data

    def _materialise_volumes(self, pod: dict) -> dict[str, str]:
        """Write each volume to <pod dir>/volumes/<name>; return mountPath -> host path."""
        folders: dict[str, Path] = {}
        texts: list[Path] = []     # ConfigMap files: they may name paths inside the pod
        for vol in pod["spec"].get("volumes") or []:
            target = self.dir / "volumes" / vol["name"]
            if "hostPath" in vol:
                folders[vol["name"]] = self.rt.host_path(self.node, vol)
                continue
            if "persistentVolumeClaim" in vol:
                folders[vol["name"]] = self._claim_folder(vol["persistentVolumeClaim"]["claimName"])
                continue
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            folders[vol["name"]] = target
            for kind, key, decode in (("configMap", "configmaps", False),
                                      ("secret", "secrets", True)):
                if kind in vol:
                    ref = vol[kind]
                    data = self._object_data(key, ref.get("name") or ref.get("secretName"),
                                             ref.get("optional"), decode=decode)
                    items = ref.get("items")
                    pairs = [(i["key"], i["path"]) for i in items] if items else \
                        [(k, k) for k in data]
                    for k, rel in pairs:
                        if k in data:
                            (target / rel).parent.mkdir(parents=True, exist_ok=True)
                            (target / rel).write_text(data[k])
                            if kind == "configMap":
                                texts.append(target / rel)
            # emptyDir and anything else (projected service-account tokens...) stay empty folders
        mounts: dict[str, str] = {}
        for c in pod["spec"]["containers"] + (pod["spec"].get("initContainers") or []):
            for m in c.get("volumeMounts") or []:
                if m["name"] in folders:
                    host = folders[m["name"]] / m.get("subPath", "")
                    mounts[m["mountPath"].rstrip("/") or "/"] = str(host).rstrip("/")
        paths = {**self._termination_paths(), **mounts}
        for text in texts:
            text.write_text(_rewrite_paths(text.read_text(), paths))
        return mounts or {"": ""}

    def _termination_paths(self) -> dict[str, str]:
        """terminationMessagePath -> the file of the first container that declares it."""
        paths: dict[str, str] = {}
        for c in self.containers:
            paths.setdefault(c.spec.get("terminationMessagePath") or TERMINATION_LOG, str(self._message_file(c)))
        return paths

    def _claim_folder(self, claim: str) -> Path:
        """The folder of this machine behind a claim: its bound PersistentVolume's hostPath or local
        path (what the persistent-volume controller bound it to)."""
        pvc = self._get_or_wait(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{claim}",
                                f"persistentvolumeclaim {claim!r} not found")
        volume = (pvc.get("spec") or {}).get("volumeName")
        if (pvc.get("status") or {}).get("phase") != "Bound" or not volume:
            raise _Waiting("ContainerCreating", f"waiting for claim {claim!r} to be bound")
        pv = self._get_or_wait(f"/api/v1/persistentvolumes/{volume}", f"persistentvolume {volume!r} not found")
        source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
        if not source or not source.get("path"):
            raise _Waiting("CreateContainerConfigError", f"claim {claim!r} is bound to {volume!r}, which is "
                                                         "not a hostPath or local volume (local nodes mount only those)")
        folder = Path(source["path"])
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _get_or_wait(self, path: str, missing: str, optional: bool = False) -> dict:
        """The object at `path`; when it does not exist: {} if `optional`, else the container waits
        (CreateContainerConfigError, `missing`), as a kubelet's does."""
        try:
            return self.rt.client.get(path)
        except kapi.ApiError as e:
            if e.status == 404 and optional:
                return {}
            if e.status == 404:
                raise _Waiting("CreateContainerConfigError", missing) from None
            raise

    def _rewrite(self, text: str, env: dict | None = None) -> str:
        text = _rewrite_paths(text, {**self.mounts, **self.container_paths})

        def resolve(m: re.Match) -> str:
            ip = self.rt.resolve(m.group(1))
            if ip is None:
                raise _Waiting("ResolvingHostname", f"waiting for {m.group(1)} to resolve")
            return ip
        return DNS_NAME.sub(resolve, text)

    def _rewrite_list(self, items: list[str], env: dict) -> list[str]:
        expanded = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                           lambda m: env.get(m.group(1), m.group(0)), s) for s in items]
        return [self._rewrite(s, env) for s in expanded]

    # status
    def _report(self) -> None:
        if not self.report:
            return
        status = self._status()
        key = json.dumps(status, sort_keys=True)
        if key == self.last_status:
            return
        try:
            self.rt.client.strategic_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
                                           {"metadata": {"uid": self.uid}, "status": status})
            self.last_status = key
        except kapi.ApiError as e:
            if e.status not in (404, 409):
                log.warning("status of %s/%s: %s", self.ns, self.name, e)
        except OSError as e:
            log.warning("status of %s/%s: %s", self.ns, self.name, e)

    def _status(self) -> dict:
        containers = []
        for c in self.containers:
            s = {"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                 "ready": c.ready and c.proc is not None, "restartCount": c.restarts,
                 "started": c.proc is not None and c.proc.poll() is None, "state": c.state()}
            if c.proc is not None:
                s["containerID"] = f"local://{c.proc.pid}"
            if c.last_terminated:
                s["lastState"] = {"terminated": c.last_terminated}
            containers.append(s)
        inits = [{"name": c.name, "image": c.spec.get("image", ""), "imageID": "",
                  "ready": bool(c.terminated and c.terminated["exitCode"] == 0),
                  "restartCount": c.restarts, "state": c.state()} for c in self.inits]
        initialized = all(c.terminated and c.terminated["exitCode"] == 0 for c in self.inits)
        if all(c.terminated for c in self.containers):
            phase = "Succeeded" if all(c.terminated["exitCode"] == 0 for c in self.containers) \
                else "Failed"
        elif any(c.proc is not None or c.restarts or c.terminated for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        ready = phase == "Running" and all(s["ready"] for s in containers)
        t = now()
        previous = {c["type"]: c for c in self.pod.get("status", {}).get("conditions") or []}

        def cond(type_: str, ok: bool) -> dict:
            status = "True" if ok else "False"
            old = previous.get(type_)
            since = old["lastTransitionTime"] if old and old.get("status") == status and \
                old.get("lastTransitionTime") else t
            return {"type": type_, "status": status, "lastTransitionTime": since,
                    "lastProbeTime": None}
        conditions = [cond("PodReadyToStartContainers", True), cond("Initialized", initialized),
                      cond("ContainersReady", ready), cond("Ready", ready),
                      cond("PodScheduled", True)]
        status = {"phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                  "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                  "startTime": self.start_time, "conditions": conditions,
                  "containerStatuses": containers}
        if inits:
            status["initContainerStatuses"] = inits
        return status


class _Waiting(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _rewrite_paths(text: str, paths: dict[str, str]) -> str:
    """Each path inside the pod (a mountPath, a terminationMessagePath) -> its folder or file here."""
    for mount in sorted((m for m in paths if m), key=len, reverse=True):
        text = re.sub(re.escape(mount) + r"(?=/|$|[^\w.-])", paths[mount].replace("\\", "\\\\"), text)
    return text


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- entry point

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.e2e.localcluster.localnodes")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes-file", help="JSON list of Node objects to register at start")
    parser.add_argument("--state-dir", required=True, help="where pods' folders and logs go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    nodes = json.loads(Path(args.nodes_file).read_text()) if args.nodes_file else []
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    runtime = Runtime(kapi.Client.from_kubeconfig(args.kubeconfig), state, nodes)

    def on_signal(signum, frame):
        runtime.stopping.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runtime.register_nodes()
    threads = [threading.Thread(target=runtime.node_loop, daemon=True, name="nodes"),
               threading.Thread(target=runtime.pod_loop, daemon=True, name="pods")]
    for t in threads:
        t.start()
    log.info("serving local nodes %s", ", ".join(n["metadata"]["name"] for n in nodes) or "(none)")
    while not runtime.stopping.wait(0.5):
        pass
    log.info("stopping: killing pod processes")
    runtime.stop()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with runtime.lock:
            if not runtime.runners:
                break
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
