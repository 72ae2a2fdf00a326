"""One pod's lifecycle on a local node: its volumes, init containers in order, then its containers,
restarted per restartPolicy and killed on a failed liveness probe; its status reported after each
pass; on deletion its processes stopped within the grace period and the pod object removed."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes import containers, volumes
from shardwise.e2e.localcluster.localnodes.containers import MAX_BACKOFF, TERMINATION_LOG, ContainerProc
from shardwise.e2e.localcluster.localnodes.podenv import PodEnvironment, Waiting
from shardwise.e2e.localcluster.localnodes.podstatus import pod_status
from shardwise.e2e.localcluster.localnodes.probes import Prober
from shardwise.e2e.localcluster.localnodes.timestamps import now

log = logging.getLogger(__name__)


class PodRunner(threading.Thread):
    """The thread that runs one pod. `host` (a NodeHost) gives the API client, the IP pool, the
    state folder and name resolution, and hears when the runner ends."""

    def __init__(self, host, pod: dict):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.host = host
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.node = pod["spec"]["nodeName"]
        self.ns, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.dir = host.dir / f"{self.ns}_{self.name}"
        self.ip = host.ips.take(pod.get("status", {}).get("podIP"))
        self.containers = [ContainerProc(c, self.dir) for c in pod["spec"]["containers"]]
        self.inits = [ContainerProc(c, self.dir) for c in pod["spec"].get("initContainers") or []]
        self.start_time = now()
        self.halt = threading.Event()
        self.report = True
        self.kill_grace = 0.0
        self.last_status: str | None = None
        self.remount = False
        self.lock = threading.Lock()
        self.environment = PodEnvironment(host.client, host.resolve, lambda: self.pod, self.ip)
        self.prober = Prober(self.environment, self.ip, self.dir)

    def update(self, pod: dict) -> None:
        with self.lock:
            before = self.pod["metadata"]
            # a kubelet mounts a pod's ConfigMaps and Secrets again whenever the pod is updated (its
            # own status reports aside): a change of its labels or annotations does it here
            if any(before.get(k) != pod["metadata"].get(k) for k in ("labels", "annotations")):
                self.remount = True
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
            containers.kill_all(self.inits + self.containers, self.kill_grace)
            self.host.ips.give_back(self.ip)
            self.host.runner_done(self)

    def _run(self) -> None:
        restart = self.pod["spec"].get("restartPolicy", "Always")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.environment.mounts = {}
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
            self._delete(pod)
            return True
        if self.remount and self.environment.mounts:
            self.remount = False
            volumes.refresh(self.environment, pod, self.dir, self.containers, self.environment.mounts)
        if not self.environment.mounts:
            try:
                self.environment.mounts = volumes.materialise(self.environment, pod, self.dir,
                                                              self.host.dir, self.containers)
            except Waiting as w:
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

    def _delete(self, pod: dict) -> None:
        """The pod is being deleted: stop its processes within its grace period (30s at most),
        then remove the object, as a kubelet does once the containers are gone."""
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        containers.kill_all(self.inits + self.containers, 30 if grace is None else min(float(grace), 30))
        self._report()
        try:
            self.host.client.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                                    {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except kapi.ApiError as e:
            if e.status not in (404, 409):
                log.warning("deleting %s/%s: %s", self.ns, self.name, e)

    def _run_inits(self, restart: str) -> bool:
        """Start or follow the init containers in order; True once every one has succeeded."""
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
        """Note an exit (restart with back-off or leave terminated, per `restart`), start the
        container when due, probe it while it runs."""
        t = time.monotonic()
        if c.proc is not None and c.proc.poll() is not None:
            code = c.proc.returncode
            info = {"exitCode": code if code >= 0 else 128 - code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": c.started_at, "finishedAt": now(),
                    **containers.termination_message(c, code)}
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
        if c.running() and self.prober.probe(c, t):
            log.info("pod %s/%s container %s failed its liveness probe; killing",
                     self.ns, self.name, c.name)
            containers.kill(c, grace=float(self.pod["spec"].get("terminationGracePeriodSeconds", 30) or 0))

    def _finished(self, restart: str) -> bool:
        return all(c.terminated is not None for c in self.containers)

    def _launch(self, c: ContainerProc) -> None:
        """Start the container's command + args with its env, paths and names rewritten; it
        waits (no start yet) while a name it uses does not resolve or an object it names is missing."""
        command = list(c.spec.get("command") or []) + list(c.spec.get("args") or [])
        if not c.spec.get("command"):
            c.waiting = ("CreateContainerError",
                         "local nodes run only containers with a command (there is no image)")
            c.next_start = time.monotonic() + 3600
            return
        c.message_file.write_bytes(b"")
        self.environment.container_paths = {
            c.spec.get("terminationMessagePath") or TERMINATION_LOG: str(c.message_file)}
        try:
            env = self.environment.env(c.spec)
            command = self.environment.rewrite_list(command, env)
        except Waiting as w:
            c.waiting = (w.reason, w.message)
            c.next_start = time.monotonic() + 0.5
            return
        finally:
            self.environment.container_paths = {}
        cwd = c.spec.get("workingDir")
        cwd = self.environment.rewrite(cwd, env) if cwd else str(self.dir)
        if not os.path.isdir(cwd):
            cwd = str(self.dir)
        containers.start(c, command, env, cwd)

    def _report(self) -> None:
        """Patch the pod's status when it changed since the last report."""
        if not self.report:
            return
        status = pod_status(self.pod, self.containers, self.inits, self.ip, self.start_time)
        key = json.dumps(status, sort_keys=True)
        if key == self.last_status:
            return
        try:
            self.host.client.strategic_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
                                             {"metadata": {"uid": self.uid}, "status": status})
            self.last_status = key
        except kapi.ApiError as e:
            if e.status not in (404, 409):
                log.warning("status of %s/%s: %s", self.ns, self.name, e)
        except OSError as e:
            log.warning("status of %s/%s: %s", self.ns, self.name, e)
