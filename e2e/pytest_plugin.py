"""pytest fixtures for tests against the real local control plane.

Load them from a conftest.py with `from shardwise.e2e.pytest_plugin import *`.

Fixtures
- `cluster` (session): the running control plane, a `Cluster`. Started once per test session in a
  temporary state folder (2 simulated 8-GPU nodes in 2 racks, 1 local node with 8 GPUs) and stopped
  at the end; or, when SHARDWISE_KUBECONFIG is set, that cluster is used and left running.
  Attributes and helpers: `kubeconfig`, `bin_dir`, `state_dir`, `client` (a small JSON client,
  shardwise.e2e.localcluster.kapi), `install_crd(path)` / `wait_crd_established()`, `operator(namespace, log)`
  (the operator running for a `with` block), `hostpath_claim(namespace, claim, folder)` (a shared
  claim on a folder of this machine, for a `with` block), `add_node(name, gpus=8, ...)` (a simulated GPU node, waits until Ready),
  `add_local_node(name, gpus=8, ...)` (a node whose pods run as local processes),
  `delete_node(name)`, `node_down(name)` / `node_up(name)` (stop / resume its heartbeat: NotReady
  after ~8s, pods evicted 2s later), `wait_node_ready(name, ready=True)`, `kubectl(*args)`.
- `kube_api` (session): a `kubernetes.client.ApiClient` for the cluster.
- `namespace` (function): a fresh namespace for the test (its default ServiceAccount exists), deleted
  afterwards.
- `kubectl` (function): `kubectl(*args, input=None, check=True) -> stdout`, run with the cluster's
  kubeconfig in the test's namespace; raises AssertionError with stderr when it fails and check=True.
- `node_factory` (function): like `cluster.add_node` / `cluster.add_local_node` (`local=True`), but
  deletes the nodes it made when the test ends.

If the Kubernetes binaries are not built (`shardwise dev build`), tests using these fixtures are
skipped with that reason, unless SHARDWISE_REQUIRE_CLUSTER is set (CI), where they fail instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardwise.e2e import build

from shardwise.e2e.localcluster import controlplane as cp
from shardwise.e2e.localcluster import nodes

from shardwise.e2e.localcluster import kapi

# A lost node is NotReady after 8 s without a heartbeat rather than `shardwise dev`'s 12: a dozen
# tests lose a node, and each waits that out (the nodes renew their Leases every ~3 s).
SESSION_SPEC = cp.ClusterSpec(nodes=2, gpus_per_node=8, racks=2, zones=1, local_nodes=1, node_grace_seconds=8)

__all__ = ["Cluster", "cluster", "kube_api", "namespace", "kubectl", "node_factory", "wait_until"]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25,
               retry_on: tuple[type[BaseException], ...] = ()):
    """Poll `predicate` until it returns something truthy; fail the test naming `what`.
    Exceptions of the `retry_on` types count as "not yet"; the last one, or the last value, is
    reported on timeout."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = predicate()
        except retry_on as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class Cluster:
    def __init__(self, kubeconfig: Path, bin_dir: Path, state_dir: Path | None = None):
        self.kubeconfig = Path(kubeconfig)
        self.bin_dir = Path(bin_dir)
        self.state_dir = state_dir
        self.client = kapi.Client.from_kubeconfig(self.kubeconfig)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                namespace: str | None = None) -> str:
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}"]
        if namespace:
            argv.append(f"--namespace={namespace}")
        proc = subprocess.run(argv + list(args), input=input, capture_output=True, text=True,
                              timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    # the ShardedModel CRD
    def install_crd(self, path: Path | str) -> None:
        """Apply a CRD file (server-side) and wait until the API server serves it."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        self.wait_crd_established()

    def wait_crd_established(self, name: str = "shardedmodels.shardwise.dev", timeout: float = 60) -> None:
        # Read the condition ourselves: `kubectl wait` on a CRD created a moment ago can fail at once
        # ("status.conditions accessor error") before the API server has written any status.
        def established() -> bool:
            crd = self.client.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            return any(c.get("type") == "Established" and c.get("status") == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])
        wait_until(established, timeout, f"CRD {name} to be Established", retry_on=(kapi.ApiError,))

    @contextlib.contextmanager
    def operator(self, namespace: str, log: Path, *options: str):
        """`shardwise operator run` against this cluster, watching one namespace (and holding its
        Lease there), for the duration of the block, with `options` added; its output goes to
        `log`, whose tail is printed when it stops."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shardwise", "operator", "run", "--kubeconfig", str(self.kubeconfig),
                 "--namespace", namespace, "--lease-namespace", namespace, "--metrics-port", "0",
                 "--health-port", "0",
                 # A tiny training job runs its 300 steps in ~8 s, less than the default 10 s between
                 # progress reads: tests that watch it Running with a checkpoint need reads that often.
                 "--progress-seconds", "1", *options], stdout=out, stderr=subprocess.STDOUT, cwd=Path(log).parent)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            print(Path(log).read_text(errors="replace")[-3000:])

    @contextlib.contextmanager
    def hostpath_claim(self, namespace: str, claim: str, folder: Path):
        """A ReadWriteMany claim `claim` in `namespace`, bound (by the volume controller) to a hostPath
        PersistentVolume on `folder`: what local pods share as a network filesystem. The volume is
        deleted after the block."""
        volume = f"{namespace}-{claim}"
        self.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder)}}}))
        try:
            self.kubectl("apply", "-f", "-", namespace=namespace, input=json.dumps({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                         "resources": {"requests": {"storage": "1Gi"}}}}))
            yield claim
        finally:
            self.kubectl("delete", "pv", volume, "--ignore-not-found", "--wait=false", check=False)

    # nodes
    def add_node(self, name: str, gpus: int = 8, *, zone: str = "zone-a", rack: str = "rack-0",
                 labels: dict | None = None, local: bool = False, wait: bool = True,
                 product: str = nodes.GPU_PRODUCT, memory_mib: int = nodes.GPU_MEMORY_MIB) -> str:
        manifest = nodes.node_manifest(name, gpus=gpus, zone=zone, rack=rack, local=local,
                                    product=product, memory_mib=memory_mib, extra_labels=labels)
        nodes.create_nodes(self.client, [manifest])
        if wait:
            self.wait_node_ready(name)
        return name

    def add_local_node(self, name: str, gpus: int = 8, **kw) -> str:
        return self.add_node(name, gpus, local=True, **kw)

    def delete_node(self, name: str) -> None:
        try:
            self.client.delete(f"/api/v1/nodes/{name}")
        except kapi.ApiError as e:
            if e.status != 404:
                raise

    def node_down(self, name: str) -> None:
        nodes.set_node_down(self.client, name, True)

    def node_up(self, name: str) -> None:
        """Resume the heartbeat; returns once the node's Lease is renewed again."""
        nodes.set_node_down(self.client, name, False)

    def wait_node_ready(self, name: str, ready: bool = True, timeout: float = 60) -> None:
        wait_until(lambda: nodes.node_ready(self.client.get(f"/api/v1/nodes/{name}")) == ready,
                   timeout, f"node {name} to be {'Ready' if ready else 'NotReady'}")


def _binaries_or_skip() -> Path:
    directory = build.bin_dir()
    missing = build.missing_binaries(directory)
    if missing:
        reason = (f"Kubernetes binaries not built ({', '.join(missing)} missing in {directory}); "
                  "run `shardwise dev build`")
        if os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
            pytest.fail(reason + " (SHARDWISE_REQUIRE_CLUSTER is set)", pytrace=False)
        pytest.skip(reason)
    return directory


@pytest.fixture(scope="session")
def cluster():
    if os.environ.get("SHARDWISE_KUBECONFIG"):
        yield Cluster(Path(os.environ["SHARDWISE_KUBECONFIG"]), build.bin_dir())
        return
    bin_dir = _binaries_or_skip()
    state = Path(tempfile.mkdtemp(prefix="shardwise-test-cluster-"))
    plane = cp.ControlPlane(state, bin_dir, die_with_parent=True)
    try:
        plane.up(SESSION_SPEC, say=lambda s: None)
    except cp.ControlPlaneError as e:
        pytest.fail(f"local control plane did not start: {e}", pytrace=False)
    try:
        yield Cluster(plane.kubeconfig, bin_dir, state)
    finally:
        plane.down()


@pytest.fixture(scope="session")
def kube_api(cluster):
    from kubernetes import config
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture
def namespace(cluster, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{secrets.token_hex(3)}"
    cluster.client.create("/api/v1/namespaces", {"metadata": {"name": name}})
    wait_until(lambda: cluster.client.exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
               30, f"the default ServiceAccount in {name}")
    yield name
    try:
        cluster.client.delete(f"/api/v1/namespaces/{name}")
    except (kapi.ApiError, OSError):
        pass


@pytest.fixture
def kubectl(cluster, namespace):
    def run(*args: str, input: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, input=input, check=check, namespace=namespace)
    return run


@pytest.fixture
def node_factory(cluster):
    made: list[str] = []

    def make(name: str, gpus: int = 8, **kw) -> str:
        made.append(name)
        return cluster.add_node(name, gpus, **kw)
    yield make
    for name in made:
        cluster.delete_node(name)
