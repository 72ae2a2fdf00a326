"""The local control plane behaves like Kubernetes: the real scheduler places nvidia.com/gpu, the
real controller-manager collects garbage, cleans up after lost nodes and evicts from failed ones,
and `shardwise dev` reports problems in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.e2e import build

from shardwise.e2e.localcluster import controlplane as cp
from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

POOL = "shardwise.dev/test-pool"


def gpu_pod(name: str, gpus: int, node_selector: dict | None = None) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeSelector": node_selector or {},
                 "containers": [{"name": "main", "image": "worker",
                                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}})


def get(kubectl, *args) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json"))


def test_pod_asking_more_gpus_than_any_node_has_stays_pending(kubectl):
    kubectl("apply", "-f", "-", input=gpu_pod("too-big", 1000))

    def unschedulable():
        conds = get(kubectl, "pod", "too-big").get("status", {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "PodScheduled"
                     and c["status"] == "False"), None)
    cond = wait_until(unschedulable, 30, "the scheduler to give up on the pod")
    assert cond["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    pod = get(kubectl, "pod", "too-big")
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")


def test_eight_gpu_pod_lands_on_the_eight_gpu_node(kubectl, namespace, node_factory):
    pool = {POOL: namespace}
    small = node_factory(f"{namespace}-g4", gpus=4, labels=pool)
    big = node_factory(f"{namespace}-g8", gpus=8, labels=pool)
    node = get(kubectl, "node", big)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert {"topology.kubernetes.io/zone", "topology.shardwise.dev/rack", "nvidia.com/gpu.clique",
            "nvidia.com/gpu.product", "nvidia.com/gpu.memory"} <= set(node["metadata"]["labels"])
    assert not node["spec"].get("taints")

    kubectl("apply", "-f", "-", input=gpu_pod("eight", 8, pool))
    pod = wait_until(lambda: (p := get(kubectl, "pod", "eight"))["status"].get("phase") == "Running"
                     and p, 30, "the 8-GPU pod to run")
    assert pod["spec"]["nodeName"] == big != small


def test_a_deleted_nodes_pods_go_and_a_failed_nodes_are_evicted_in_seconds(kubectl, namespace, node_factory,
                                                                           cluster):
    """Two lost nodes at once: the pod garbage collector waits 40 s for a deleted node to come back
    (not configurable), and the failed node's whole cycle fits in that wait."""
    doomed, flaky = f"{namespace}-doomed", f"{namespace}-flaky"
    for node in (doomed, flaky):
        node_factory(node, gpus=8, labels={POOL: node})
    kubectl("apply", "-f", "-", input=gpu_pod("on-doomed", 2, {POOL: doomed}))
    kubectl("apply", "-f", "-", input=gpu_pod("on-flaky", 8, {POOL: flaky}))
    for pod in ("on-doomed", "on-flaky"):
        wait_until(lambda pod=pod: get(kubectl, "pod", pod)["status"].get("phase") == "Running", 30, f"{pod} to run")

    # A deleted node: its pods are collected.
    cluster.delete_node(doomed)

    # A failed node: NotReady, tainted, its pods evicted in seconds.
    cluster.node_down(flaky)
    cluster.wait_node_ready(flaky, ready=False, timeout=40)
    taints = {t["key"] for t in get(kubectl, "node", flaky)["spec"].get("taints") or []}
    assert "node.kubernetes.io/unreachable" in taints
    wait_until(lambda: get(kubectl, "pod", "on-flaky")["metadata"].get("deletionTimestamp"), 30,
               "the pod on the failed node to be evicted")
    # back up: kwok takes the node again and the evicted pod, still Terminating, is finished off
    cluster.node_up(flaky)
    cluster.wait_node_ready(flaky, timeout=40)
    wait_until(lambda: "on-flaky" not in kubectl("get", "pods", "-o", "name"), 30,
               "the evicted pod to go once its node is back")

    wait_until(lambda: "on-doomed" not in kubectl("get", "pods", "-o", "name"), 120,
               "the pod of the deleted node to go")


def test_deleting_an_owner_deletes_its_dependents(kubectl):
    owner = json.loads(kubectl("create", "configmap", "owner", "--from-literal=a=1", "-o", "json"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"]}
    for name in ("dep-1", "dep-2"):
        kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap", "data": {"b": "2"},
            "metadata": {"name": name, "ownerReferences": [ref]}}))
    kubectl("delete", "configmap", "owner")
    wait_until(lambda: "dep-" not in kubectl("get", "configmaps", "-o", "name"), 30,
               "the garbage collector to delete the dependents")


# ---------------------------------------------------------------- shardwise dev

def dev(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from shardwise.cli import main; sys.exit(main())",
                           "dev", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_dev_env_gives_a_working_shell(cluster):
    if cluster.state_dir is None:
        pytest.skip("the session uses an external cluster (SHARDWISE_KUBECONFIG)")
    out = dev("--state-dir", str(cluster.state_dir), "env")
    assert out.returncode == 0, out.stderr
    shell = subprocess.run(["bash", "-c", f'{out.stdout}\nkubectl get nodes -o name'],
                           capture_output=True, text=True, timeout=60, env={**os.environ})
    assert shell.returncode == 0, shell.stderr
    assert "node/local-node-0" in shell.stdout


def test_dev_up_on_a_running_cluster_says_so(cluster):
    if cluster.state_dir is None:
        pytest.skip("the session uses an external cluster (SHARDWISE_KUBECONFIG)")
    out = dev("--state-dir", str(cluster.state_dir), "up")
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0
    assert "already running" in out.stderr


def test_dev_up_with_a_taken_port_names_it(cluster, tmp_path):
    port = cluster.client.port  # the session's API server holds it
    out = dev("--state-dir", str(tmp_path / "dev"), "up", "--port", str(port))
    assert out.returncode == 1
    assert out.stderr.strip() == f"shardwise dev: kube-apiserver: port 127.0.0.1:{port} is taken"


def test_dev_up_without_binaries_says_what_is_missing(tmp_path):
    out = dev("--state-dir", str(tmp_path / "dev"), "up",
              env={"SHARDWISE_CACHE": str(tmp_path / "empty-cache")})
    assert out.returncode == 1
    assert "etcd: not built" in out.stderr and "shardwise dev build" in out.stderr
    assert out.stderr.strip().count("\n") == 0


def test_a_crashed_component_is_named_with_its_log(cluster, tmp_path):
    # A cache whose kube-scheduler dies at start; every other binary is the real one.
    bin_dir = tmp_path / "cache" / "bin" / build.bin_dir().name
    bin_dir.mkdir(parents=True)
    for name in build.ALL_BINARIES:
        (bin_dir / name).symlink_to(cluster.bin_dir / name)
    (bin_dir / "kube-scheduler").unlink()
    (bin_dir / "kube-scheduler").write_text("#!/bin/sh\necho 'E0000 bad scheduler config' >&2\n"
                                            "exit 3\n")
    (bin_dir / "kube-scheduler").chmod(0o755)
    state = tmp_path / "dev"
    out = dev("--state-dir", str(state), "up", "--nodes", "0",
              env={"SHARDWISE_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 1
    line = out.stderr.strip()
    assert line.count("\n") == 0, line
    assert line.startswith("shardwise dev: kube-scheduler exited (exit 3)")
    assert line.endswith(f"see {state / 'logs' / 'kube-scheduler.log'}")
    # the half-started cluster was stopped
    assert not cp.ControlPlane(state).is_running()


def test_kube_api_fixture_talks_to_the_cluster(kube_api, namespace):
    from kubernetes import client
    core = client.CoreV1Api(kube_api)
    assert core.read_namespace(namespace).status.phase == "Active"
    gpus = [n.status.allocatable.get("nvidia.com/gpu") for n in core.list_node().items]
    assert gpus and all(g is not None for g in gpus)


def test_dev_refuses_to_wipe_a_folder_that_is_not_its_own(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for action in ("up", "down"):
        out = dev("--state-dir", str(precious), action)
        assert out.returncode == 1
        assert "is not a local cluster's state folder" in out.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_fixtures_skip_without_binaries_unless_the_cluster_is_required(tmp_path):
    (tmp_path / "conftest.py").write_text("from shardwise.e2e.pytest_plugin import *\n")
    (tmp_path / "test_uses_cluster.py").write_text("def test_it(namespace):\n    pass\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHARDWISE_KUBECONFIG", "SHARDWISE_REQUIRE_CLUSTER")}
    env["SHARDWISE_CACHE"] = str(tmp_path / "empty-cache")

    def pytest_run(**extra) -> str:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               str(tmp_path)], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env={**env, **extra}).stdout
    skipped = pytest_run()
    assert "1 skipped" in skipped and "run `shardwise dev build`" in skipped
    required = pytest_run(SHARDWISE_REQUIRE_CLUSTER="1")
    assert "1 error" in required and "SHARDWISE_REQUIRE_CLUSTER is set" in required
