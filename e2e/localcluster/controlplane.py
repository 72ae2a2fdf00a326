"""The local Kubernetes control plane: real etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and kwok, on loopback, as plain processes.

Everything lives in one state folder (`$SHARDWISE_DEV_DIR`, default ~/.local/state/shardwise/dev):
certificates, the admin kubeconfig, etcd's data, one log per component and `state.json` with the
process ids, so that `shardwise dev down` from another shell can stop what `dev up` started.

Nodes: every Node object that does not carry `shardwise.dev/local-node=true` is simulated by kwok
(node heartbeat through its Lease, pods become Running/Ready). `shardwise.dev/node-down=true` on a
Node takes it away from kwok (and from the local-node runtime), so its Lease stops being renewed and
the node lifecycle controller marks it NotReady and evicts its pods: the way tests kill a node.
"""
from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from shardwise.e2e import build
from shardwise.e2e.localcluster import kapi, kwok_config, pki
from shardwise.e2e.localcluster.errors import ControlPlaneError
from shardwise.e2e.localcluster.nodes import (GPU_MEMORY_MIB, GPU_PRODUCT, LOCAL_NODE_LABEL,
                                              NODE_DOWN_LABEL,
                                              create_nodes, node_manifest, topology, wait_nodes_ready)

# kwok manages every Node that is neither a local node nor marked down.
KWOK_SELECTOR = f"{LOCAL_NODE_LABEL}!=true,{NODE_DOWN_LABEL}!=true"

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.244.0.0/16"  # IPs kwok gives pods on simulated nodes

# Node failure in seconds instead of minutes: kwok renews a node's Lease every lease/4 seconds; the
# node lifecycle controller declares the node NotReady/Unreachable after the grace period without a
# renewal and taints it NoExecute; pods tolerate that taint for TOLERATION seconds (the default the
# API server writes into every pod), then they are evicted. A ClusterSpec may shorten the grace
# period (the heartbeats shorten with it): a test suite that loses many nodes waits less for each.
NODE_LEASE_SECONDS = 20
NODE_GRACE_SECONDS = 12
NODE_MONITOR_GRACE = f"{NODE_GRACE_SECONDS}s"
TOLERATION_SECONDS = 2

def default_state_dir() -> Path:
    if os.environ.get("SHARDWISE_DEV_DIR"):
        return Path(os.environ["SHARDWISE_DEV_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "shardwise" / "dev"


@dataclass
class ClusterSpec:
    nodes: int = 4
    gpus_per_node: int = 8
    racks: int = 2
    zones: int = 1
    local_nodes: int = 0
    local_gpus_per_node: int | None = None  # default: gpus_per_node
    gpu_product: str = GPU_PRODUCT
    gpu_memory_mib: int = GPU_MEMORY_MIB
    apiserver_port: int = 0  # 0: any free port
    # seconds without a heartbeat before a node is NotReady; every node renews its Lease 3-4 times
    # in that time, so a node that misses one renewal (a busy machine) stays Ready
    node_grace_seconds: int = NODE_GRACE_SECONDS


def kwok_lease_seconds(spec: ClusterSpec) -> int:
    """The Lease duration kwok gives its nodes (renewed every quarter of it): 20 s at the default
    grace period, shorter in step with a shorter one."""
    return max(4, NODE_LEASE_SECONDS * spec.node_grace_seconds // NODE_GRACE_SECONDS)


def local_renew_seconds(spec: ClusterSpec) -> float:
    """How often the local-node runtime renews its nodes' Leases: a third of the grace period."""
    return spec.node_grace_seconds / 3


# ---------------------------------------------------------------- the nodes of a ClusterSpec

def simulated_nodes(spec: ClusterSpec) -> list[dict]:
    return [node_manifest(f"gpu-node-{i:03d}", gpus=spec.gpus_per_node, zone=zone, rack=rack,
                          product=spec.gpu_product, memory_mib=spec.gpu_memory_mib)
            for i, (zone, rack) in enumerate(topology(spec.nodes, spec.racks, spec.zones))]


def local_nodes(spec: ClusterSpec) -> list[dict]:
    gpus = spec.gpus_per_node if spec.local_gpus_per_node is None else spec.local_gpus_per_node
    return [node_manifest(f"local-node-{i}", gpus=gpus, zone=zone, rack=rack, local=True,
                          product=spec.gpu_product, memory_mib=spec.gpu_memory_mib)
            for i, (zone, rack) in enumerate(topology(spec.local_nodes, spec.racks, spec.zones))]


# ---------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return False
        except OSError:
            return True


def _alive(pid: int, marker: str) -> bool:
    """True if `pid` runs and its command line contains `marker` (guards against reused pids)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except (OSError, IndexError):
        return False


def _last_error_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines[-60:]):
        low = line.lower()
        if "address already in use" in low:
            return "a port it needs is taken (address already in use)"
    for line in reversed(lines[-60:]):
        if any(w in line for w in ("error", "Error", "E1", "F1", "fatal", "panic")):
            return line.strip()[:200]
    return ""


def _kubeconfig(server: str, pki_dir: Path, user: str) -> dict:
    def b64(name: str) -> str:
        return base64.b64encode((pki_dir / name).read_bytes()).decode()
    return {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "shardwise-dev", "cluster": {
            "server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "shardwise-dev",
                      "context": {"cluster": "shardwise-dev", "user": user}}],
        "current-context": "shardwise-dev",
    }


@dataclass
class Component:
    name: str
    pid: int
    marker: str  # a string of its command line, to recognise it
    log: str
    port: int = 0


@dataclass
class State:
    server: str
    bin_dir: str
    spec: dict
    components: list[Component] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> "State | None":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        try:
            raw["components"] = [Component(**c) for c in raw.get("components", [])]
            return cls(**raw)
        except TypeError:  # written at the very start of `up`, before anything ran
            return None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)


class ControlPlane:
    """Start, inspect and stop one local control plane rooted at a state folder."""

    def __init__(self, state_dir: Path | str | None = None, bin_dir: Path | str | None = None,
                 die_with_parent: bool = False):
        """die_with_parent: components get SIGTERM if this process dies without `down()` (a test
        session killed from outside); `shardwise dev up` leaves it off, its cluster outlives it."""
        self.dir = Path(state_dir) if state_dir else default_state_dir()
        self.die_with_parent = die_with_parent
        self.bin = Path(bin_dir) if bin_dir else build.bin_dir()
        self._procs: dict[str, subprocess.Popen] = {}
        self._state: State | None = None

    # paths
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def log_of(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def state(self) -> State | None:
        return State.load(self.state_file)

    def client(self) -> kapi.Client:
        return kapi.Client.from_kubeconfig(self.kubeconfig)

    # inspection
    def component_status(self) -> list[tuple[Component, bool]]:
        state = self.state()
        if not state:
            return []
        return [(c, self._is_alive(c)) for c in state.components]

    def _is_alive(self, c: Component) -> bool:
        proc = self._procs.get(c.name)
        if proc is not None:
            return proc.poll() is None
        return _alive(c.pid, c.marker)

    def is_running(self) -> bool:
        status = self.component_status()
        return bool(status) and any(alive for _, alive in status)

    def check_components(self) -> None:
        """Raise naming the first component that died, with its log file."""
        for c, alive in self.component_status():
            if not alive:
                code = ""
                proc = self._procs.get(c.name)
                if proc is not None and proc.returncode is not None:
                    code = f" (exit {proc.returncode})"
                why = _last_error_line(Path(c.log))
                raise ControlPlaneError(f"{c.name} exited{code}{': ' + why if why else ''}; "
                                        f"see {c.log}")

    # start
    def _start(self, name: str, argv: list[str], marker: str, port: int = 0,
               env: dict | None = None) -> None:
        log_path = self.log_of(name)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=self.dir, env=env,
                                    preexec_fn=_die_with_parent(name) if self.die_with_parent
                                    else None)
        self._procs[name] = proc
        self._state.components.append(Component(name, proc.pid, marker, str(log_path), port))
        self._state.save(self.state_file)

    def _wait_http(self, name: str, url: str, timeout: float, context=None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_components()
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{name} did not become healthy in {timeout:.0f}s; "
                                        f"see {self.log_of(name)}")
            time.sleep(0.2)

    def up(self, spec: ClusterSpec | None = None, say: Callable[[str], None] = print,
           timeout: float = 120) -> None:
        spec = spec or ClusterSpec()
        if self.is_running():
            raise ControlPlaneError(f"a local cluster is already running (state: {self.dir}); "
                                    "`shardwise dev down` stops it")
        missing = build.missing_binaries(self.bin)
        if missing:
            raise ControlPlaneError(f"{missing[0]}: not built in {self.bin}; "
                                    "run `shardwise dev build` first")
        if spec.apiserver_port and port_taken(spec.apiserver_port):
            raise ControlPlaneError(f"kube-apiserver: port 127.0.0.1:{spec.apiserver_port} is taken")
        if self.dir.exists():
            self._check_ours()
            shutil.rmtree(self.dir)  # leftovers of a cluster that is no longer running
        self.logs.mkdir(parents=True)
        self.state_file.write_text("{}")  # marks the folder as ours from the first moment
        t0 = time.monotonic()
        try:
            self._up(spec, say, timeout)
        except BaseException:
            self.down(remove_state=False)
            raise
        say(f"cluster ready in {time.monotonic() - t0:.1f}s: {spec.nodes} simulated and "
            f"{spec.local_nodes} local nodes (kubeconfig: {self.kubeconfig})")

    def _up(self, spec: ClusterSpec, say, timeout: float) -> None:
        """The components in the order they need each other, each step within what is left of
        `timeout`: etcd, the API server, the controllers and kwok, then the nodes."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(1, deadline - time.monotonic())
        pki_dir = self.dir / "pki"
        pki.generate(pki_dir, SERVICE_IP)
        api_port = spec.apiserver_port or free_port()
        server = f"https://127.0.0.1:{api_port}"
        self._state = State(server=server, bin_dir=str(self.bin), spec=asdict(spec))
        self._state.save(self.state_file)
        self._write_kubeconfigs(server, pki_dir)
        say("starting etcd")
        etcd_url = self._start_etcd(left)
        say("starting kube-apiserver")
        self._start_apiserver(etcd_url, api_port, pki_dir, left)
        say("starting kube-controller-manager, kube-scheduler and kwok")
        health_ports = self._start_controllers(pki_dir, spec)
        self._start_kwok(spec)
        client = self.client()
        names = self._start_nodes(spec, client, say)
        for name, port in health_ports:
            self._wait_http(name, f"https://127.0.0.1:{port}/healthz", left(), _insecure_context())
        if names:
            wait_nodes_ready(client, names, left(), self.check_components, say)
        # Pods can only be created once the namespace has its default ServiceAccount.
        self._wait_for(lambda: client.exists("/api/v1/namespaces/default/serviceaccounts/default"),
                       "kube-controller-manager", "the default ServiceAccount", left())

    def _write_kubeconfigs(self, server: str, pki_dir: Path) -> None:
        """One kubeconfig per user of the API server; the admin's is the cluster's kubeconfig."""
        for user in ("admin", "controller-manager", "scheduler", "kwok", "localnodes"):
            (self.dir / f"{user}.kubeconfig").write_text(
                yaml.safe_dump(_kubeconfig(server, pki_dir, user)))
        os.replace(self.dir / "admin.kubeconfig", self.kubeconfig)
        self.kubeconfig.chmod(0o600)

    def _start_etcd(self, left: Callable[[], float]) -> str:
        """etcd, once healthy; its client URL."""
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._start("etcd", [
            str(self.bin / "etcd"), "--name=dev", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=dev={peer_url}", "--log-level=warn",
            # A throwaway development store: skipping fsync keeps a busy laptop responsive.
            "--unsafe-no-fsync", "--quota-backend-bytes=4294967296",
        ], str(self.bin / "etcd"), etcd_port)
        self._wait_http("etcd", f"{etcd_url}/health", left())
        return etcd_url

    def _start_apiserver(self, etcd_url: str, api_port: int, p: Path,
                         left: Callable[[], float]) -> None:
        """kube-apiserver on `api_port` with the certificates in `p`, once ready."""
        self._start("kube-apiserver", [
            str(self.bin / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=Node,RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true", "--profiling=false",
            # The `kubernetes` Service cannot point at a loopback address; nothing in-cluster needs it.
            "--endpoint-reconciler-type=none",
            # Without a request-header CA every component logs about the missing bundle; no
            # certificate of ours has the allowed name, so no one can use the header auth.
            f"--requestheader-client-ca-file={p / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--default-not-ready-toleration-seconds={TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={TOLERATION_SECONDS}",
        ], str(self.bin / "kube-apiserver"), api_port)
        ca_ctx = ssl.create_default_context(cafile=str(p / "ca.crt"))
        ca_ctx.load_cert_chain(str(p / "admin.crt"), str(p / "admin.key"))
        self._wait_http("kube-apiserver", f"https://127.0.0.1:{api_port}/readyz", left(), ca_ctx)

    def _start_controllers(self, p: Path, spec: ClusterSpec) -> list[tuple[str, int]]:
        """kube-controller-manager and kube-scheduler; (name, port) of each one's /healthz."""
        kcm_port, sched_port = free_port(), free_port()
        self._start("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={self.dir / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--leader-elect=false",
            f"--root-ca-file={p / 'ca.crt'}", f"--service-account-private-key-file={p / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--use-service-account-credentials=true",
            "--controllers=*", "--node-monitor-period=1s",
            f"--node-monitor-grace-period={spec.node_grace_seconds}s",
            "--node-eviction-rate=100", "--secondary-node-eviction-rate=100",
            "--kube-api-qps=200", "--kube-api-burst=400", "--profiling=false",
        ], str(self.bin / "kube-controller-manager"), kcm_port)
        sched_config = self.dir / "scheduler.yaml"
        sched_config.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.dir / "scheduler.kubeconfig"),
                                 "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False}}))
        self._start("kube-scheduler", [
            str(self.bin / "kube-scheduler"), f"--config={sched_config}",
            f"--authentication-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={self.dir / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--profiling=false",
        ], str(self.bin / "kube-scheduler"), sched_port)
        return [("kube-controller-manager", kcm_port), ("kube-scheduler", sched_port)]

    def _start_kwok(self, spec: ClusterSpec) -> None:
        """kwok, the simulated kubelet of every node that is neither local nor down."""
        kwok_file = self.dir / "kwok.yaml"
        kwok_file.write_text(kwok_config.config_text())
        self._start("kwok", [
            str(self.bin / "kwok"), f"--kubeconfig={self.dir / 'kwok.kubeconfig'}",
            f"--config={kwok_file}", "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={KWOK_SELECTOR}",
            f"--node-lease-duration-seconds={kwok_lease_seconds(spec)}", f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1", "--v=WARN",  # it logs every Lease renewal at INFO
        ], str(self.bin / "kwok"))

    def _start_nodes(self, spec: ClusterSpec, client: kapi.Client, say) -> list[str]:
        """The simulated nodes' objects and the local-node runtime; the names of every node."""
        sim = simulated_nodes(spec)
        if sim:
            say(f"creating {len(sim)} simulated GPU nodes")
            create_nodes(client, sim)
        if spec.local_nodes:
            say(f"starting {spec.local_nodes} local nodes")
            nodes_file = self.dir / "local-nodes.json"
            nodes_file.write_text(json.dumps(local_nodes(spec), indent=1))
            self._start("local-nodes", [
                sys.executable, "-m", "shardwise.e2e.localcluster.localnodes",
                f"--kubeconfig={self.dir / 'localnodes.kubeconfig'}",
                f"--nodes-file={nodes_file}", f"--state-dir={self.dir / 'pods'}",
                f"--renew-seconds={local_renew_seconds(spec)}",
            ], "shardwise.e2e.localcluster.localnodes")
        return [n["metadata"]["name"] for n in sim + local_nodes(spec)]

    def _check_ours(self) -> None:
        """Refuse to delete a folder that is not a state folder (say, a mistyped $SHARDWISE_DEV_DIR)."""
        if self.state_file.exists() or not any(self.dir.iterdir()):
            return
        raise ControlPlaneError(f"{self.dir} exists and is not a local cluster's state folder "
                                "(no state.json); choose another with --state-dir or "
                                "$SHARDWISE_DEV_DIR")

    def _wait_for(self, predicate, component: str, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self.check_components()
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{component}: {what} did not appear in {timeout:.0f}s; "
                                        f"see {self.log_of(component)}")
            time.sleep(0.2)

    # stop
    def down(self, remove_state: bool = True, say: Callable[[str], None] = lambda s: None) -> bool:
        """Stop every component (newest first) and remove the state folder. True if any ran."""
        state = self.state()
        stopped = False
        if state:
            for c in reversed(state.components):
                if self._is_alive(c):
                    stopped = True
                    say(f"stopping {c.name}")
                    self._terminate(c)
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs.clear()
        if remove_state and self.dir.exists():
            self._check_ours()
            shutil.rmtree(self.dir, ignore_errors=True)
        return stopped

    def _terminate(self, c: Component, grace: float = 5) -> None:
        try:  # the whole process group: the local-node runtime's pods die with it
            os.killpg(c.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._is_alive(c):
            time.sleep(0.05)
        if self._is_alive(c):
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self._procs.get(c.name)
        if proc is not None:
            proc.wait()


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent(component: str):
    """For the child between fork and exec: the kernel signals it when the forking thread ends.
    SIGKILL for the binaries (a throwaway cluster; the API server's graceful shutdown would hang
    on a dead etcd), SIGTERM for the local-node runtime so that it kills its pods first."""
    sig = signal.SIGTERM if component == "local-nodes" else signal.SIGKILL

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, sig)
    return preexec


def _insecure_context() -> ssl.SSLContext:
    # The scheduler and controller-manager serve /healthz with a self-signed certificate.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
