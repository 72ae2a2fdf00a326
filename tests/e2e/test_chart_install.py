"""The chart on a live cluster: `helm install` against the local control plane, and the operator
running with nothing but the chart's RBAC.

- install: CRD established, the Deployment available, RBAC bound to the release's ServiceAccount, the
  built-in edit/view roles extended to ShardedModels;
- RBAC: the operator logs in as the chart's ServiceAccount (a token from the TokenRequest API, the
  identity the Deployment's pods get) and drives a ShardedModel through create, node loss, recovery
  and delete; the API server must refuse nothing;
- Deployment: the rendered Deployment runs on a local node (pods as processes): both replicas pass
  the /healthz probe, one leads, and another leads when the leader's pod goes.

They rely on the local control plane's simulated and local nodes (the `cluster` fixture); on kind,
e2e/kind/run.sh covers the same ground with real images.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from shardwise.e2e.build import cache_root
from shardwise.e2e.localcluster.nodes import LOCAL_NODE_LABEL, SIMULATED_LABEL
from shardwise.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
TEST_LABEL = "shardwise.dev/chart-test"


def helm(cluster, *args: str) -> str:
    proc = subprocess.run([str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/shardwise-helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/shardwise-helm-config",
                               "HELM_DATA_HOME": "/tmp/shardwise-helm-data"})
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture
def release(cluster, namespace):
    """Installs the chart into the test's namespace; uninstalls it (and its cluster-scoped RBAC) after."""
    installed: list[str] = []

    def install(*args: str, node_label: str = SIMULATED_LABEL) -> str:
        # Named so that the objects (Deployment, ServiceAccount) carry the release name as it is.
        name = f"shardwise-{secrets.token_hex(3)}"
        # By default the Deployment's pods go to the simulated nodes (kwok reports them Running, with
        # no process); a local node executes the operator's command for real.
        helm(cluster, "install", name, str(CHART), "--namespace", namespace, "--wait", "--timeout", "120s",
             "--set-string", "nodeSelector." + node_label.replace(".", r"\.") + "=true", *args)
        installed.append(name)
        return name
    yield install
    for name in installed:
        helm(cluster, "uninstall", name, "--namespace", namespace, "--wait")


def get(cluster, *args: str, namespace: str | None = None) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json", namespace=namespace))


def test_helm_install_establishes_the_crd_and_runs_the_operator_deployment(cluster, namespace, release):
    name = release()
    cluster.wait_crd_established()
    crd = get(cluster, "crd", "shardedmodels.shardwise.dev")
    assert crd["spec"]["names"]["shortNames"] == ["sm"]
    assert crd["spec"]["versions"][0]["subresources"].keys() >= {"status", "scale"}

    dep = get(cluster, "deployment", name, namespace=namespace)
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == name
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # --wait returned: both replicas are available (simulated nodes report them Ready).
    assert dep["status"].get("availableReplicas") == 2
    status = helm(cluster, "status", name, "--namespace", namespace, "-o", "json")
    assert json.loads(status)["info"]["status"] == "deployed"

    # The ClusterRole is bound to the release's ServiceAccount, which may read nodes but not secrets.
    who = f"system:serviceaccount:{namespace}:{name}"

    def can(*args: str) -> str:
        return cluster.kubectl("auth", "can-i", *args, f"--as={who}", check=False).strip()
    assert can("list", "nodes") == "yes"
    assert can("create", "pods", "-n", "default") == "yes"
    assert can("list", "secrets", "-n", namespace) == "no"
    assert can("delete", "nodes") == "no"

    # Namespace users get ShardedModels through the built-in roles: edit may create and scale them,
    # view may only read them (aggregated by the controller-manager, so allow it a moment).
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", namespace=namespace)
    cluster.kubectl("create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", namespace=namespace)

    def user_can(user: str, *args: str) -> str:
        return cluster.kubectl("auth", "can-i", *args, f"--as={user}", "-n", namespace, check=False).strip()
    wait_until(lambda: user_can("alice", "create", "shardedmodels.shardwise.dev") == "yes", 30,
               "the edit role to include ShardedModels")
    assert user_can("alice", "update", "shardedmodels.shardwise.dev", "--subresource=scale") == "yes"
    assert user_can("alice", "update", "shardedmodels.shardwise.dev", "--subresource=status") == "no"
    wait_until(lambda: user_can("bob", "list", "shardedmodels.shardwise.dev") == "yes", 30,
               "the view role to include ShardedModels")
    assert user_can("bob", "delete", "shardedmodels.shardwise.dev") == "no"


def _service_account_kubeconfig(cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount itself, with a short-lived token."""
    token = cluster.kubectl("create", "token", sa, "--duration=30m", namespace=namespace).strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    (cl,) = admin["clusters"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [cl], "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": cl["name"], "user": sa}}],
        "current-context": sa}))
    return path


def test_operator_works_with_only_the_charts_rbac(cluster, namespace, release, tmp_path):
    # Models live in their own namespace, which the release watches: the chart then binds the
    # namespaced rules there only, the strictest layout it renders.
    models = f"{namespace[:50]}-models"
    cluster.kubectl("create", "namespace", models)
    name = release("--set", f"operator.watchNamespaces={{{models}}}")
    sa_config = _service_account_kubeconfig(cluster, namespace, name, tmp_path / "sa.kubeconfig")
    whoami = subprocess.run([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={sa_config}", "auth", "whoami",
                             "-o", "json"], capture_output=True, text=True, timeout=30)
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == \
        f"system:serviceaccount:{namespace}:{name}"

    # Three simulated 8-GPU nodes of our own, selected by the model, so other tests' nodes don't count.
    nodes = [f"{models[:40]}-n{i}" for i in range(3)]
    for n in nodes:
        cluster.add_node(n, gpus=8, rack="rack-chart", labels={TEST_LABEL: models[:63]})
    log = tmp_path / "operator.log"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    with open(log, "wb") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "shardwise", "operator", "run", "--kubeconfig", str(sa_config),
             "--namespace", models, "--lease-namespace", namespace, "--metrics-port", "0", "--health-port", "0",
             "--worker-image", "shardwise/worker:test"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _drive_a_model_through_its_life(cluster, models, nodes)
    finally:
        operator.terminate()
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(5)
        for n in nodes:
            cluster.delete_node(n)
        cluster.kubectl("delete", "namespace", models, "--wait=false", check=False)
    text = log.read_text()
    refused = [line for line in text.splitlines() if "forbidden" in line.lower() or " 403" in line]
    assert not refused, "the API server refused the operator:\n" + "\n".join(refused[:10])
    assert "leader:" in text  # it took the Lease in the release namespace with the chart's Role


def _drive_a_model_through_its_life(cluster, ns: str, nodes: list[str]) -> None:
    sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
          "metadata": {"name": "rbac", "namespace": ns},
          "spec": {"model": {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": 32,
                             "heads": 32, "kvHeads": 8, "hiddenSize": 4096, "vocabSize": 128256},
                   "parallelism": {"tensor": 8, "pipeline": 2, "replicas": 1},
                   "placement": {"nodeSelector": {TEST_LABEL: ns[:63]}},
                   "recovery": {"backoffSeconds": 0, "maxRestarts": 3}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))

    def model() -> dict:
        return get(cluster, "sm", "rbac", namespace=ns)

    def ready(min_restarts: int = 0):
        def check():
            st = model().get("status", {})
            return st.get("phase") == "Ready" and st.get("restarts", 0) >= min_restarts
        return check

    # Create: pods, the two Services, the plan ConfigMap and the PDB, status written.
    wait_until(ready(), 90, "the model Ready under the chart's RBAC")
    assert {s["metadata"]["name"] for s in get(cluster, "services", namespace=ns)["items"]} >= {"rbac", "rbac-ranks"}
    get(cluster, "configmap", "rbac-plan", namespace=ns)
    get(cluster, "pdb", "rbac", namespace=ns)

    # Node loss: the group is torn down (deletecollection, forced deletes) and recreated elsewhere.
    used = {p["spec"]["nodeName"] for p in get(cluster, "pods", "-l", "shardwise.dev/model=rbac", namespace=ns)["items"]}
    cluster.node_down(sorted(used)[0])
    wait_until(ready(min_restarts=1), 120, "the model Ready again after losing a node")
    events = [e["reason"] for e in get(cluster, "events", namespace=ns)["items"]
              if e["involvedObject"].get("name") == "rbac"]
    assert "Recovering" in events  # kopf posted Events with the chart's RBAC

    # Delete: the garbage collector takes the pods, Services, ConfigMap and PDB with it.
    cluster.kubectl("delete", "sm", "rbac", namespace=ns)
    wait_until(lambda: not get(cluster, "pods", "-l", "shardwise.dev/model=rbac", namespace=ns)["items"], 60,
               "the model's pods garbage-collected")


def test_the_charts_deployment_runs_two_operators_and_another_leads_when_the_leader_goes(
        cluster, namespace, release, tmp_path):
    """The Deployment as rendered (command, args, downward-API env, named probe ports, Lease flags) run
    on a local node, whose runtime executes pods as processes and probes them: both replicas go Ready on
    /healthz, one leads, the model is reconciled, and when the leader's pod is deleted another leads."""
    local = get(cluster, "nodes", "-l", f"{LOCAL_NODE_LABEL}=true")["items"]
    if not local:
        pytest.skip("this cluster has no local node (shardwise dev up --local-nodes 1)")
    models = f"{namespace[:50]}-models"
    cluster.kubectl("create", "namespace", models)
    # No image on a local node: the container's command runs as a process of this machine, with no
    # in-cluster credentials, so it is handed a kubeconfig of the chart's ServiceAccount. Each pod has
    # its own loopback IP; binding to it keeps the two replicas' ports apart.
    name = release("--set", "replicaCount=0", "--set", f"operator.watchNamespaces={{{models}}}",
                   node_label=LOCAL_NODE_LABEL)
    # Not under /tmp: the local runtime maps the pod's /tmp (an emptyDir in the chart) to a folder of
    # its own, paths in args included.
    outside_tmp = Path(tempfile.mkdtemp(prefix="chart-test-", dir=cache_root()))
    sa_config = _service_account_kubeconfig(cluster, namespace, name, outside_tmp / "sa.kubeconfig")
    helm(cluster, "upgrade", name, str(CHART), "--namespace", namespace, "--reuse-values", "--wait",
         "--timeout", "120s", "--set", "replicaCount=2",
         "--set", f"operator.extraArgs={{--kubeconfig={sa_config},--bind-address=$(POD_IP)}}")
    try:
        dep = get(cluster, "deployment", name, namespace=namespace)
        assert dep["status"].get("readyReplicas") == 2  # both answered the readiness probe on /healthz

        def holder() -> str:
            # both replicas are Ready (a standby answers /healthz too) possibly before either has
            # made the Lease
            if not cluster.kubectl("get", "lease", name, "--ignore-not-found", namespace=namespace).strip():
                return ""
            lease = get(cluster, "lease", name, namespace=namespace)
            return (lease.get("spec") or {}).get("holderIdentity") or ""
        pods = {p["metadata"]["name"] for p in get(cluster, "pods", "-l", f"app.kubernetes.io/instance={name}",
                                                    namespace=namespace)["items"]}
        leader = wait_until(lambda: holder() in pods and holder(), 60, "one operator pod to hold the Lease")

        nodes = [f"{models[:40]}-d{i}" for i in range(2)]
        for n in nodes:
            cluster.add_node(n, gpus=8, rack="rack-chart", labels={TEST_LABEL: models[:63]})
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
              "metadata": {"name": "dep", "namespace": models},
              "spec": {"model": {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": 32,
                                 "heads": 32, "kvHeads": 8, "hiddenSize": 4096, "vocabSize": 128256},
                       "parallelism": {"tensor": 4, "pipeline": 2, "replicas": 1},
                       "placement": {"nodeSelector": {TEST_LABEL: models[:63]}}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(sm))

        def phase_and_replicas() -> tuple:
            st = get(cluster, "sm", "dep", namespace=models).get("status", {})
            return st.get("phase"), st.get("readyReplicas")
        wait_until(lambda: phase_and_replicas() == ("Ready", 1), 90, "the model Ready, reconciled by the Deployment")

        # The leader goes (and gives the Lease up as it stops); another operator pod takes the Lease -
        # the standby, or the Deployment's replacement pod if it is quicker - and reconciles the next
        # change.
        cluster.kubectl("delete", "pod", leader, "--wait=false", namespace=namespace)
        wait_until(lambda: holder() not in ("", leader), 60, "another operator pod to take the Lease")
        cluster.kubectl("scale", "sm/dep", "--replicas=2", namespace=models)
        wait_until(lambda: phase_and_replicas() == ("Ready", 2), 90, "the scaled model Ready under the new leader")
        cluster.kubectl("delete", "sm", "dep", namespace=models)
    finally:
        shutil.rmtree(outside_tmp, ignore_errors=True)
        for n in [f"{models[:40]}-d{i}" for i in range(2)]:
            cluster.delete_node(n)
        cluster.kubectl("delete", "namespace", models, "--wait=false", check=False)
