"""A kind cluster shaped like a small GPU cluster, created with the real `kind` CLI on our node image.

One control plane and four workers in two racks (kind-config.yaml, next to this module). kind has no GPUs and no
device plugin: `advertise_gpus` patches fake `nvidia.com/gpu` capacity into each worker's status, so
the scheduler places GPU-asking pods exactly as on a GPU cluster, and the CPU worker image runs the
ranks on CPU over gloo, across nodes, on the real pod network.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardwise.e2e import build

from shardwise.e2e.kind import registry, space
from shardwise.e2e.kind.docker import DockerError, capabilities_missing, docker, image_exists, image_size
from shardwise.e2e.kind.nodeimage import NODE_IMAGE

# Package data next to this module, so an installed package finds it too (kind reads it as a file).
CONFIG = Path(__file__).resolve().parent / "kind-config.yaml"
DEFAULT_NAME = "shardwise"
GPU_NODE_LABEL = "nvidia.com/gpu.present=true"
FAKE_GPUS = 4

# Without CAP_SYS_RESOURCE (a restricted sandbox: see shardwise.e2e.kind.docker) a node cannot lower a
# process's OOM score, and containerd sets -998 on every pod sandbox: runc then fails to start it.
# containerd's own switch for this case (made for rootless nodes) keeps scores at or above its own.
_NO_SYS_RESOURCE_PATCH = """\
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
"""


SHARED_MOUNT = "/var/lib/shardwise/shared"


def effective_config(config: Path, lacking: list[str], shared: Path) -> dict:
    """The kind config as given, plus the local registry's name for the nodes, what this host's
    missing capabilities require of them, and one folder of this host mounted into every worker at
    SHARED_MOUNT (where hostPath volumes make ReadWriteMany claims, as NFS would)."""
    data = yaml.safe_load(config.read_text())
    for node in data["nodes"]:
        if node["role"] == "worker":
            node.setdefault("extraMounts", []).append({"hostPath": str(shared), "containerPath": SHARED_MOUNT})
    patches = data.setdefault("containerdConfigPatches", [])
    patches.append(registry.containerd_patch())
    if "CAP_SYS_RESOURCE" in lacking:
        patches.append(_NO_SYS_RESOURCE_PATCH)
    return data


class DiskFull(RuntimeError):
    """A node could not unpack an image: Docker's disk is full (see e2e/kind/space.py)."""


@dataclass
class KindCluster:
    name: str = DEFAULT_NAME
    bin_dir: Path | None = None

    def __post_init__(self) -> None:
        self.bin_dir = Path(self.bin_dir) if self.bin_dir else build.bin_dir()

    @property
    def kubeconfig(self) -> Path:
        return build.cache_root() / "kind" / f"{self.name}.kubeconfig"

    @property
    def shared_dir(self) -> Path:
        """This host's side of SHARED_MOUNT: what a test writes here, every worker node sees."""
        return build.cache_root() / "kind" / f"{self.name}-shared"

    def shared_claim(self, namespace: str, claim: str, folder: str, read_only: bool = False) -> Path:
        """A claim bound to a hostPath volume on `folder` of the shared mount: every pod on every worker
        sees the same files (ReadWriteMany). Returns the folder on this host (world-writable, since the
        worker runs as a non-root user)."""
        host = self.shared_dir / folder
        host.mkdir(parents=True, exist_ok=True)
        host.chmod(0o777)
        mode = "ReadOnlyMany" if read_only else "ReadWriteMany"
        volume = f"{namespace}-{claim}"
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode], "storageClassName": "",
                      "persistentVolumeReclaimPolicy": "Retain",
                      "hostPath": {"path": f"{SHARED_MOUNT}/{folder}", "type": "Directory"}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": claim, "namespace": namespace},
             "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": volume,
                      "resources": {"requests": {"storage": "1Gi"}}}}]}))
        return host

    def _tool(self, name: str) -> str:
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise DockerError(f"{name} is not built: run `shardwise kind build`")
        return str(path)

    def kind(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run([self._tool("kind"), *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "KUBECONFIG": str(self.kubeconfig)})
        if proc.returncode != 0:
            # kind's own error line, not the stack trace after it.
            lines = [l for l in (proc.stderr or "").splitlines() if l.startswith("ERROR:")] \
                or (proc.stderr or "").strip().splitlines() or [f"exit {proc.returncode}"]
            raise DockerError(f"kind {args[0]} failed: {lines[0].removeprefix('ERROR: ')}")
        return proc.stdout or ""

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120,
                check: bool = True) -> str:
        proc = subprocess.run([self._tool("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise DockerError(f"kubectl {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def helm(self, *args: str, timeout: float = 600) -> str:
        home = build.cache_root() / "helm"
        env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
        proc = subprocess.run([self._tool("helm"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise DockerError(f"helm {args[0]} failed: {proc.stderr.strip()}")
        return proc.stdout

    def exists(self) -> bool:
        return self.name in self.kind("get", "clusters").split()

    def create(self, image: str = NODE_IMAGE, config: Path = CONFIG, say=print,
               room_for: tuple[str, ...] = ()) -> None:
        """Make the cluster; first check that Docker's disk has room for every GPU node to unpack
        the images `room_for` names (space.check_room)."""
        self._tool("kind")   # the binaries first: that check needs no Docker daemon
        for ref in (image, *room_for):
            if not image_exists(ref):
                raise DockerError(f"image {ref} is not there: build it with `shardwise kind build`")
        space.check_room([image_size(ref) for ref in room_for], self.gpu_node_count(config))
        if self.exists():
            raise DockerError(f"a kind cluster named {self.name!r} already exists: use it "
                              f"(`shardwise kind up --reuse`) or delete it (`shardwise kind down "
                              f"--name {self.name}`)")
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        effective = self.kubeconfig.with_suffix(".kind-config.yaml")
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        effective.write_text(yaml.safe_dump(effective_config(config, capabilities_missing(),
                                                             self.shared_dir)))
        say(f"creating kind cluster {self.name!r} from {image} ({config.name})")
        start = time.monotonic()
        self.kind("create", "cluster", "--name", self.name, "--image", image, "--config", str(effective),
                  "--kubeconfig", str(self.kubeconfig), "--wait", "300s", timeout=900)
        # kind's --wait is for the control plane: workers may still be joining. Pods scheduled now
        # (the operator's two replicas) would all land on the first Ready worker, and a preferred
        # anti-affinity cannot move them later.
        self.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=300s", timeout=360)
        registry.ensure_running(say)
        self.advertise_gpus()
        say(f"cluster {self.name!r} up in {time.monotonic() - start:.0f}s "
            f"(KUBECONFIG={self.kubeconfig})")

    def delete(self) -> None:
        self.kind("delete", "cluster", "--name", self.name, "--kubeconfig", str(self.kubeconfig))
        shutil.rmtree(self.shared_dir, ignore_errors=True)

    def gpu_node_count(self, config: Path = CONFIG) -> int:
        """How many nodes of the cluster's config are GPU nodes (those a worker pod can land on)."""
        key, _, value = GPU_NODE_LABEL.partition("=")
        nodes = yaml.safe_load(config.read_text()).get("nodes", [])
        return sum(1 for n in nodes if str((n.get("labels") or {}).get(key)) == value)

    def nodes(self, selector: str = GPU_NODE_LABEL) -> list[str]:
        out = self.kubectl("get", "nodes", "-l", selector, "-o", "jsonpath={.items[*].metadata.name}")
        return out.split()

    def advertise_gpus(self, count: int = FAKE_GPUS) -> None:
        """Fake `nvidia.com/gpu` capacity on each GPU-labelled worker (the kubelet keeps extended
        resources it did not register; do it again after a node container restarts)."""
        patch = json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(count)}])
        for node in self.nodes():
            self.kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", patch)

    def node_serves_gpus(self, node: str, count: int = FAKE_GPUS) -> bool:
        """Whether `node` is Ready with `count` GPUs allocatable: what a pod of a model needs of it.
        A node container just started again is listed (its Node object never went away) well
        before its kubelet is back."""
        status = json.loads(self.kubectl("get", "node", node, "-o", "json")).get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        return ready and (status.get("allocatable") or {}).get("nvidia.com/gpu") == str(count)

    def push_product(self, names, say=print):
        """Push the operator and worker images to the registry the nodes pull from; returns the
        names to give the chart (`localhost:5001/...`)."""
        registry.ensure_running(say)
        pushed = type(names)(operator=registry.push(names.operator, say),
                             worker=registry.push(names.worker, say))
        registry.collect_garbage(say)   # the layers of the images these tags named before
        return pushed

    def get(self, kind: str, name: str, namespace: str) -> dict:
        return json.loads(self.kubectl("get", kind, name, "-n", namespace, "-o", "json"))

    def ready_pods(self, namespace: str, selector: str) -> list[dict]:
        """Pods matching `selector` that are Ready and not being deleted."""
        pods = json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def check_pulls(self, namespace: str) -> None:
        """Raise DiskFull when a pod's image cannot be unpacked for want of room on its node: no
        retry of the kubelet's will ever succeed, so a test waiting for the pod should stop now."""
        pods = json.loads(self.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
        for pod in pods:
            for status in pod.get("status", {}).get("containerStatuses", []) or []:
                message = ((status.get("state") or {}).get("waiting") or {}).get("message", "")
                if "no space left on device" in message:
                    raise DiskFull(f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')}: "
                                   f"{message.splitlines()[0][:300]}")

    @contextlib.contextmanager
    def port_forward(self, namespace: str, target: str, remote: int):
        """`kubectl port-forward` of `target` (svc/NAME, pod/NAME) to a free port on 127.0.0.1;
        yields its base URL."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([self._tool("kubectl"), f"--kubeconfig={self.kubeconfig}", "-n", namespace,
                                 "port-forward", "--address", "127.0.0.1", target, f"{port}:{remote}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    def complete(self, namespace: str, service: str, prompt: str, port: int = 8000,
                 timeout: float = 300) -> str:
        """A greedy completion through the model's Service (16 tokens), retried until it answers."""
        body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
        deadline = time.monotonic() + timeout
        while True:
            with self.port_forward(namespace, f"svc/{service}", port) as url:
                for _ in range(30):   # the forward needs a moment to listen
                    try:
                        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                                     headers={"Content-Type": "application/json"})
                        with urllib.request.urlopen(req, timeout=120) as resp:
                            return json.load(resp)["choices"][0]["text"]
                    except OSError as e:
                        last = e
                        time.sleep(1)
            if time.monotonic() > deadline:
                raise DockerError(f"no completion from svc/{service} within {timeout:.0f}s: {last}")

    def diagnose(self, namespaces: list[str], operator_namespace: str = "shardwise-system") -> str:
        """What a failed wait leaves to read before the cluster is deleted: every ShardedModel's
        status, the nodes' GPUs, and the pods and recent Events of `namespaces`, with the operator's
        last log lines. Each part is best-effort: one whose kubectl printed nothing (or failed) reads
        "(none)", one whose kubectl could not run names why."""
        def run(*args: str) -> str:
            try:
                return self.kubectl(*args, timeout=60, check=False).rstrip()
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"({' '.join(args[:3])}: {e})"
        parts = [("ShardedModels", run("get", "sm", "-A", "-o", "wide")),
                 ("statuses", run("get", "sm", "-A", "-o",
                                  "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}: "
                                  "{.status.phase} {.status.message}{'\\n'}{end}")),
                 ("GPUs", run("get", "nodes", "-o", "custom-columns=NODE:.metadata.name,"
                              "READY:.status.conditions[?(@.type=='Ready')].status,GPUS:.status.allocatable.nvidia\\.com/gpu"))]
        for ns in dict.fromkeys([*namespaces, operator_namespace]):
            parts += [(f"pods in {ns}", run("get", "pods", "-n", ns, "-o", "wide")),
                      (f"events in {ns}", "\n".join(run("get", "events", "-n", ns,
                                                         "--sort-by=.lastTimestamp").splitlines()[-25:]))]
        parts.append(("operator log", run("logs", "-n", operator_namespace, "-l",
                                          "app.kubernetes.io/name=shardwise", "--tail=60")))
        return "\n".join(f"--- {title}\n{text or '(none)'}" for title, text in parts)

    def stop_node(self, node: str) -> None:
        docker("stop", node)

    def start_node(self, node: str) -> None:
        docker("start", node)
