"""This machine as the host of the local nodes: which nodes it serves, every pod it has seen (to
resolve names), and the runner of each pod bound to one of its nodes. Two loops keep it current:
one over the Node objects (heartbeat, nodes down or deleted), one watching the pods."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from shardwise.e2e.localcluster import kapi
from shardwise.e2e.localcluster.localnodes import dns, nodedisk
from shardwise.e2e.localcluster.localnodes.heartbeat import Heartbeat
from shardwise.e2e.localcluster.localnodes.ips import IPPool
from shardwise.e2e.localcluster.localnodes.pods import PodRunner
from shardwise.e2e.localcluster.nodes import LOCAL_NODE_LABEL, NODE_DOWN_LABEL

log = logging.getLogger(__name__)


class NodeHost:
    """The local nodes this process serves, the pods it has seen and the runners of their pods."""

    def __init__(self, client: kapi.Client, state_dir: Path, nodes: list[dict], renew_every: float | None = None):
        self.client = client
        self.renew_every = renew_every   # seconds between Lease renewals (None: the heartbeat's default)
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
        heartbeat = Heartbeat(self.client) if self.renew_every is None else Heartbeat(self.client, self.renew_every)
        while not self.stopping.is_set():
            try:
                self._follow_nodes(heartbeat)
            except Exception as e:  # the API server may restart; keep trying
                log.warning("node loop: %s", e)
            self.stopping.wait(1.0)

    def _follow_nodes(self, heartbeat: Heartbeat) -> None:
        """One pass over the local Node objects: serve the alive ones, stop the pods of nodes down
        or deleted, wipe the disks of deleted ones, start the pods of nodes that came (back)."""
        items = self.client.get("/api/v1/nodes", labelSelector=f"{LOCAL_NODE_LABEL}=true")["items"]
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
            heartbeat.forget(name)
            self.drop_node(name)
        for name in deleted:
            nodedisk.wipe_node(self.dir, name)
        heartbeat.beat(alive, came)
        for name in came:
            log.info("serving node %s", name)
            self.resync_node(name)

    def drop_node(self, name: str) -> None:
        with self.lock:
            victims = [r for r in self.runners.values() if r.node == name]
        for runner in victims:
            runner.stop(grace=0, report=False)

    def resync_node(self, name: str) -> None:
        with self.lock:
            pods = [p for p in self.pods.values() if p["spec"].get("nodeName") == name]
        for pod in pods:
            self.sync_pod(pod)

    # pods
    def pod_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                rv = self._list_pods()
                while not self.stopping.is_set():
                    rv = self._watch_pods(rv)
            except Exception as e:
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; listing again", e)
                    self.stopping.wait(1.0)

    def _list_pods(self) -> str:
        """Every pod, synced; the listing's resourceVersion to watch from."""
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
        return listing["metadata"]["resourceVersion"]

    def _watch_pods(self, rv: str) -> str:
        """Follow one watch of the pods from `rv`; the resourceVersion it reached."""
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
        return rv

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

    def runner_done(self, runner: PodRunner) -> None:
        with self.lock:
            if self.runners.get(runner.uid) is runner:
                del self.runners[runner.uid]

    def resolve(self, name: str) -> str | None:
        """A cluster DNS name's IP among the pods seen (there is no cluster DNS)."""
        with self.lock:
            pods = list(self.pods.values())
        return dns.resolve(name, pods, self.client)

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
        for runner in runners:
            runner.stop(grace=2, report=False)

    def wait_runners_done(self, timeout: float) -> None:
        """Until every runner has ended (its processes killed), at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self.runners:
                    break
            time.sleep(0.05)
