"""The operator against the real local control plane (etcd, kube-apiserver, scheduler,
controller-manager) with kwok-simulated GPU nodes: pods are scheduled for real and kwok marks them
Running and Ready (no worker runs). Each test gets its own namespace, its own nodes (labelled for it,
selected by the model's nodeSelector) and its own operator process watching that namespace.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardwise.e2e.pytest_plugin import wait_until
from shardwise.operator.render import renderer

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "shardedmodels.shardwise.dev.yaml"
TEST_LABEL = "shardwise.dev/test"
RACK = "topology.shardwise.dev/rack"


# ---------------------------------------------------------------- cluster access

@pytest.fixture(scope="module")
def kubeconfig(request, tmp_path_factory):
    """The session's control plane when the e2e plugin provides one, else one started here."""
    try:
        cluster = request.getfixturevalue("cluster")
        path = getattr(cluster, "kubeconfig", None) or cluster
        yield str(path)
        return
    except pytest.FixtureLookupError:
        pass
    from shardwise.e2e import build
    from shardwise.e2e.localcluster import controlplane
    if build.missing_binaries(build.bin_dir()):
        pytest.skip("Kubernetes binaries not built (python3 e2e/build.py)")
    plane = controlplane.ControlPlane(tmp_path_factory.mktemp("cp"))
    plane.up(controlplane.ClusterSpec(nodes=0), say=lambda s: None)
    try:
        yield str(plane.kubeconfig)
    finally:
        plane.down()


class Kube:
    def __init__(self, kubeconfig: str, namespace: str):
        from shardwise.e2e import build
        self.kubeconfig, self.ns = kubeconfig, namespace
        self.env = {**os.environ, "KUBECONFIG": kubeconfig,
                    "PATH": f"{build.bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(["kubectl", *args], env=self.env, input=input, capture_output=True, text=True,
                              timeout=60)
        if check and proc.returncode:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def get(self, kind: str, name: str = "", namespaced: bool = True, selector: str = "") -> dict:
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespaced:
            args += ["-n", self.ns]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args))

    def apply(self, obj: dict) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def model(self, name: str) -> dict:
        return self.get("sm", name)

    def pods(self, model: str) -> list[dict]:
        return [p for p in self.get("pods", selector=f"shardwise.dev/model={model}")["items"]]

    def add_nodes(self, names_racks: list[tuple[str, str]], gpus: int = 8) -> None:
        from shardwise.e2e.localcluster.nodes import node_manifest
        for name, rack in names_racks:
            self.apply(node_manifest(name, gpus=gpus, zone="zone-a", rack=rack,
                                     extra_labels={TEST_LABEL: self.ns}))
        wait(lambda: all(_node_ready(self.get("node", n, namespaced=False)) for n, _ in names_racks),
             60, "nodes Ready")

    def node_down(self, name: str) -> None:
        """Stop the node's heartbeat: NotReady after the (shortened) grace period, pods evicted."""
        self.kubectl("label", "node", name, "shardwise.dev/node-down=true", "--overwrite")


def _node_ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))


def wait(predicate, timeout: float, what: str, interval: float = 0.5):
    return wait_until(predicate, timeout, what, interval, retry_on=(AssertionError,))


class Operator:
    """`shardwise operator run` as its own process, watching one namespace."""

    def __init__(self, kube: Kube, log: Path):
        self.kube, self.log, self.proc = kube, log, None

    def start(self) -> "Operator":
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardwise", "operator", "run", "--kubeconfig", self.kube.kubeconfig,
             "--namespace", self.kube.ns, "--lease-namespace", self.kube.ns, "--metrics-port", "0",
             "--health-port", "0", "--worker-image", "shardwise/worker:test", "--lease-duration", "6",
             # kwok runs no probe pod: models given by a local path are read by the operator itself
             "--model-root", "/"],
            stdout=out, stderr=subprocess.STDOUT, env=self.kube.env, cwd=ROOT)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def kube(kubeconfig):
    ns = f"sw-op-{uuid.uuid4().hex[:6]}"
    k = Kube(kubeconfig, ns)
    k.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    k.kubectl("wait", "--for=condition=Established", "crd/shardedmodels.shardwise.dev", "--timeout=30s")
    k.kubectl("create", "namespace", ns)
    yield k
    k.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    k.kubectl("delete", "nodes", "-l", f"{TEST_LABEL}={ns}", "--wait=false", check=False)


@pytest.fixture
def operator(kube, tmp_path):
    op = Operator(kube, tmp_path / "operator.log").start()
    yield op
    op.stop()
    if op.log.exists():
        print(op.log.read_text()[-4000:])


def model(kube: Kube, name: str, tensor: int | None, pipeline: int | None, replicas: int, **spec) -> dict:
    parallelism = {"replicas": replicas}
    if tensor:
        parallelism["tensor"] = tensor
    if pipeline:
        parallelism["pipeline"] = pipeline
    body = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name, "namespace": kube.ns},
            "spec": {"model": {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": 32,
                               "heads": 32, "kvHeads": 8, "hiddenSize": 4096, "vocabSize": 128256},
                     "parallelism": parallelism,
                     "placement": {"nodeSelector": {TEST_LABEL: kube.ns}},
                     "recovery": {"backoffSeconds": 0, "maxRestarts": 3}}}
    body["spec"].update(spec)
    kube.apply(body)
    return body


def ready(kube: Kube, name: str, replicas: int | None = None):
    def check():
        sm = kube.model(name)
        st = sm.get("status", {})
        ok = st.get("phase") == "Ready" and st.get("observedGeneration") == sm["metadata"]["generation"]
        if replicas is not None:
            ok = ok and st.get("readyReplicas") == replicas
        return sm if ok else None
    return check


def stage_nodes(kube: Kube, name: str) -> dict[int, list[str]]:
    """replica -> node of each stage, from the pods that run (not from what the operator claims)."""
    out: dict[int, dict[int, str]] = {}
    for p in kube.pods(name):
        if p["metadata"].get("deletionTimestamp"):
            continue
        labels = p["metadata"]["labels"]
        out.setdefault(int(labels["shardwise.dev/replica"]), {})[int(labels["shardwise.dev/stage"])] = \
            p["spec"].get("nodeName")
    return {r: [s[k] for k in sorted(s)] for r, s in out.items()}


def rack_of(kube: Kube, node: str) -> str:
    return kube.get("node", node, namespaced=False)["metadata"]["labels"][RACK]


# ---------------------------------------------------------------- tests

def test_create_ready_with_planned_placement_then_delete_collects_everything(kube, operator):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-a0", f"{ns}-rack-a"), (f"{ns}-a1", f"{ns}-rack-a"),
                    (f"{ns}-b0", f"{ns}-rack-b"), (f"{ns}-b1", f"{ns}-rack-b")])
    t0 = time.monotonic()
    model(kube, "llama", tensor=8, pipeline=2, replicas=2)
    sm = wait(ready(kube, "llama", 2), 90, "llama Ready")
    print(f"created -> Ready in {time.monotonic() - t0:.1f}s")

    placed = stage_nodes(kube, "llama")
    assert sorted(placed) == [0, 1] and all(len(nodes) == 2 for nodes in placed.values())
    # TP=8 fills a node: each stage on its own node, a replica's stages inside one rack, replicas
    # spread over the two racks.
    racks = {r: {rack_of(kube, n) for n in nodes} for r, nodes in placed.items()}
    assert all(len(rs) == 1 for rs in racks.values()), racks
    assert racks[0] != racks[1]
    status = sm["status"]
    claimed = {(p["replica"], p["stage"]): p["node"] for p in status["plan"]["placements"]}
    assert claimed == {(r, s): n for r, nodes in placed.items() for s, n in enumerate(nodes)}
    assert status["readyShards"] == 4 and status["endpoint"].startswith(f"http://llama.{ns}.svc")
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    for pod in kube.pods("llama"):
        res = pod["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "8"
    assert {s["metadata"]["name"] for s in kube.get("services")["items"]} >= {"llama", "llama-ranks"}
    plan_json = json.loads(renderer.configmap_contract(kube.get("configmap", "llama-plan")))
    assert len(plan_json["plan"]["placements"]) == 4   # the pod contract: the whole plan and more
    assert kube.get("pdb", "llama")["spec"]["minAvailable"] == 2

    # Deleting needs no running operator: no finalizer, only ownerReferences and the garbage collector.
    assert not kube.model("llama")["metadata"].get("finalizers")
    operator.stop()
    t0 = time.monotonic()
    kube.kubectl("delete", "sm", "llama", "-n", ns, "--timeout=20s")
    print(f"delete returned in {time.monotonic() - t0:.1f}s")
    wait(lambda: not kube.pods("llama") and not kube.get("configmaps", selector="shardwise.dev/model=llama")["items"]
         and not kube.get("services", selector="shardwise.dev/model=llama")["items"]
         and not kube.get("pdb", selector="shardwise.dev/model=llama")["items"], 60, "garbage collection")
    print(f"deleted -> collected in {time.monotonic() - t0:.1f}s")


def test_node_not_ready_regroups_inside_the_same_rack(kube, operator):
    ns = kube.ns
    # Rack a has three nodes, rack b one: a TP=8 x PP=2 group fits only in rack a, and still does
    # after one of its nodes is lost.
    kube.add_nodes([(f"{ns}-a0", f"{ns}-rack-a"), (f"{ns}-a1", f"{ns}-rack-a"), (f"{ns}-a2", f"{ns}-rack-a"),
                    (f"{ns}-b0", f"{ns}-rack-b")])
    model(kube, "m", tensor=8, pipeline=2, replicas=1)
    wait(ready(kube, "m", 1), 90, "m Ready")
    before = stage_nodes(kube, "m")[0]
    assert {rack_of(kube, n) for n in before} == {f"{ns}-rack-a"}

    lost = before[1]
    t0 = time.monotonic()
    kube.node_down(lost)
    wait(lambda: kube.model("m")["status"].get("phase") in ("Recovering", "Starting")
         or kube.model("m")["status"].get("restarts", 0) >= 1, 60, "recovery to begin")
    sm = wait(lambda: (lambda s: s if s["status"]["phase"] == "Ready" and s["status"]["restarts"] >= 1 else None)(
        kube.model("m")), 90, "Ready again")
    took = time.monotonic() - t0
    after = stage_nodes(kube, "m")[0]
    assert lost not in after
    assert {rack_of(kube, n) for n in after} == {f"{ns}-rack-a"}, after
    assert sm["status"]["restarts"] == 1
    assert sm["status"]["groups"][0]["restarts"] == 1 and "NotReady" in sm["status"]["groups"][0]["lastFailure"]
    reasons = [e["reason"] for e in kube.get("events", selector="")["items"]
               if e["involvedObject"].get("name") == "m"]
    assert "Recovering" in reasons and "Recovered" in reasons
    print(f"node NotReady -> Ready again in {took:.1f}s")


def test_deleted_node_moves_the_whole_group_to_a_rack_with_room(kube, operator):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-a0", f"{ns}-rack-a"), (f"{ns}-a1", f"{ns}-rack-a"),
                    (f"{ns}-b0", f"{ns}-rack-b"), (f"{ns}-b1", f"{ns}-rack-b")])
    model(kube, "m", tensor=8, pipeline=2, replicas=1)
    wait(ready(kube, "m", 1), 90, "m Ready")
    before = stage_nodes(kube, "m")[0]
    (old_rack,) = {rack_of(kube, n) for n in before}
    kube.kubectl("delete", "node", before[0], "--wait=false")
    sm = wait(lambda: (lambda s: s if s["status"]["phase"] == "Ready" and s["status"]["restarts"] >= 1 else None)(
        kube.model("m")), 90, "Ready again")
    after = stage_nodes(kube, "m")[0]
    racks = {rack_of(kube, n) for n in after}
    # One node left in the old rack: the group moved, whole, to the other rack.
    assert len(racks) == 1 and racks != {old_rack}, after
    assert sm["status"]["restarts"] == 1


def test_scale_up_and_down_with_kubectl_scale(kube, operator):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n{i}", f"{ns}-rack-{i % 2}") for i in range(4)])
    model(kube, "s", tensor=4, pipeline=2, replicas=1)
    wait(ready(kube, "s", 1), 90, "s Ready with 1 replica")
    kube.kubectl("scale", "sm/s", "--replicas", "3", "-n", ns)
    sm = wait(ready(kube, "s", 3), 90, "s Ready with 3 replicas")
    assert sorted(stage_nodes(kube, "s")) == [0, 1, 2]
    assert sm["status"]["replicas"] == 3 and sm["status"]["readyShards"] == 6
    kube.kubectl("scale", "sm/s", "--replicas", "1", "-n", ns)
    sm = wait(ready(kube, "s", 1), 60, "s Ready with 1 replica")
    wait(lambda: sorted(stage_nodes(kube, "s")) == [0], 60, "replicas 1 and 2 gone")
    assert sm["status"]["replicas"] == 1
    assert [p["replica"] for p in sm["status"]["plan"]["placements"]] == [0, 0]


def test_operator_killed_mid_reconcile_creates_no_duplicates(kube, operator):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n{i}", f"{ns}-rack-{i % 2}") for i in range(4)])
    model(kube, "k", tensor=2, pipeline=2, replicas=4)
    # Kill it as soon as the first pod exists: it is in the middle of creating the groups.
    wait(lambda: kube.pods("k"), 60, "first pod", interval=0.05)
    operator.kill()
    created_before_kill = len(kube.pods("k"))
    operator.start()
    sm = wait(ready(kube, "k", 4), 90, "k Ready after the restart")
    pods = kube.pods("k")
    keys = [(p["metadata"]["labels"]["shardwise.dev/replica"], p["metadata"]["labels"]["shardwise.dev/stage"])
            for p in pods]
    assert len(keys) == 8 and len(set(keys)) == 8, sorted(keys)
    attempts = {str(g["replica"]): str(g["attempt"]) for g in sm["status"]["groups"]}
    assert all(p["metadata"]["labels"]["shardwise.dev/attempt"] == attempts[p["metadata"]["labels"]["shardwise.dev/replica"]]
               for p in pods)
    events = [(e["reason"], e["message"]) for e in kube.get("events")["items"] if e["involvedObject"].get("name") == "k"]
    assert sm["status"]["restarts"] == 0, (sm["status"]["groups"], events)
    print(f"{created_before_kill} pod(s) existed when the operator was killed")


def test_infeasible_and_inconsistent_specs_end_in_clear_conditions(kube, operator, tmp_path):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n0", f"{ns}-rack-a")])
    # More GPUs per stage than any node has: Pending, and the condition says why.
    model(kube, "big", tensor=16, pipeline=1, replicas=1,
          model={"uri": "/models/big", "parameters": 8_000_000_000, "layers": 32, "heads": 32, "kvHeads": 16})
    # A model the operator can read (a local config.json) whose 24 heads TP=16 does not divide: the
    # schema cannot know the heads, the operator can.
    hf = tmp_path / "tiny"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 24,
                                                "num_key_value_heads": 8, "hidden_size": 768,
                                                "vocab_size": 1000, "intermediate_size": 2048}))
    model(kube, "odd", tensor=16, pipeline=1, replicas=1, model={"uri": str(hf)})
    # A model that is not there and gives no hints to size it.
    model(kube, "missing", tensor=1, pipeline=1, replicas=1, model={"uri": "/nowhere/model"})

    def condition(name):
        st = kube.model(name).get("status", {})
        planned = {c["type"]: c for c in st.get("conditions", [])}.get("Planned")
        return (st.get("phase"), planned) if planned and planned["status"] == "False" else None

    phase, cond = wait(lambda: condition("big"), 60, "big's condition")
    assert phase == "Pending" and cond["reason"] == "NoFeasiblePlan"
    assert "16 GPUs" in cond["message"] and "\n" not in cond["message"]
    phase, cond = wait(lambda: condition("odd"), 60, "odd's condition")
    assert phase == "Failed" and cond["reason"] == "InvalidSpec"
    assert "does not divide" in cond["message"] and "24" in cond["message"]
    phase, cond = wait(lambda: condition("missing"), 60, "missing's condition")
    assert phase == "Failed" and cond["reason"] == "InvalidSpec" and "/nowhere/model" in cond["message"]
    assert not kube.pods("big") and not kube.pods("odd") and not kube.pods("missing")
    # No crash loop: the operator is alive and still serving the namespace.
    assert operator.proc.poll() is None
    # Capacity arrives: the infeasible one becomes Ready without anyone touching it.
    kube.add_nodes([(f"{ns}-n1", f"{ns}-rack-a")], gpus=16)
    wait(ready(kube, "big", 1), 90, "big Ready once a 16-GPU node exists")


def test_two_operators_one_active_and_the_standby_takes_over(kube, operator, tmp_path):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n0", f"{ns}-rack-a"), (f"{ns}-n1", f"{ns}-rack-a")])
    standby = Operator(kube, tmp_path / "standby.log").start()
    try:
        model(kube, "h", tensor=4, pipeline=1, replicas=1)
        wait(ready(kube, "h", 1), 90, "h Ready")
        lease = kube.get("lease", "shardwise-operator")
        holder = lease["spec"]["holderIdentity"]
        assert holder
        active, waiting = (operator, standby) if str(operator.proc.pid) in holder else (standby, operator)
        active.kill()
        kube.kubectl("scale", "sm/h", "--replicas", "2", "-n", ns)
        wait(ready(kube, "h", 2), 90, "h scaled by the standby")
        assert kube.get("lease", "shardwise-operator")["spec"]["holderIdentity"] != holder
        assert len(kube.pods("h")) == 2
    finally:
        standby.stop()


def test_a_leader_frozen_for_20_s_is_replaced_and_steps_down_on_resume_without_writing_status(
        kube, operator, tmp_path):
    """Two operators; the leader is frozen (SIGSTOP) for 20 s: the standby takes the Lease, scales one
    model and recovers another's lost pod about as fast, once it leads, as a live leader did;
    resumed (SIGCONT), the old leader steps down (exit 3) and the models' status is still what the
    new leader wrote."""
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n0", f"{ns}-rack-a"), (f"{ns}-n1", f"{ns}-rack-a")])
    standby = Operator(kube, tmp_path / "standby.log").start()
    try:
        model(kube, "a", tensor=4, pipeline=1, replicas=1)
        model(kube, "b", tensor=4, pipeline=1, replicas=1)
        wait(ready(kube, "a", 1), 90, "a Ready")
        wait(ready(kube, "b", 1), 90, "b Ready")
        baseline = _recover_a_lost_pod(kube, "b")
        holder = kube.get("lease", "shardwise-operator")["spec"]["holderIdentity"]
        leader, other = (operator, standby) if holder.endswith(f"-{operator.proc.pid}") else (standby, operator)
        assert holder.endswith(f"-{leader.proc.pid}")

        leader.proc.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        kube.kubectl("scale", "sm/a", "--replicas", "2", "-n", ns)
        wait(lambda: kube.get("lease", "shardwise-operator")["spec"]["holderIdentity"] != holder, 20,
             "the standby to take the lease", interval=0.2)
        took_over = time.monotonic() - frozen
        wait(ready(kube, "a", 2), 60, "a scaled by the new leader")
        recovery = _recover_a_lost_pod(kube, "b")
        assert recovery < baseline + 5, f"b recovered in {recovery:.1f}s under the new leader, {baseline:.1f}s before"
        assert time.monotonic() - frozen < 20, "the new leader took longer than the freeze"

        time.sleep(max(0.0, 20 - (time.monotonic() - frozen)))
        written = {m: kube.model(m)["status"] for m in ("a", "b")}
        assert len(written["a"]["groups"]) == 2 and written["b"]["restarts"] == 2
        leader.proc.send_signal(signal.SIGCONT)
        assert leader.proc.wait(15) == 3, "the resumed old leader did not step down"
        text = leader.log.read_text(errors="replace")
        assert "stepping down" in text and "Traceback" not in text
        time.sleep(2)
        for m in ("a", "b"):
            now = kube.model(m)["status"]
            for key in ("groups", "readyReplicas", "restarts", "plan", "phase"):
                assert now.get(key) == written[m].get(key), (m, key, now.get(key), written[m].get(key))
        assert other.proc.poll() is None
        assert kube.get("lease", "shardwise-operator")["spec"]["holderIdentity"].endswith(f"-{other.proc.pid}")
        print(f"leader frozen -> standby leads in {took_over:.1f}s; a lost pod of b replaced and Ready in "
              f"{recovery:.1f}s under the new leader, {baseline:.1f}s under the first")
    finally:
        for op in (operator, standby):
            if op.proc and op.proc.poll() is None:
                op.proc.send_signal(signal.SIGCONT)
        standby.stop()


def _recover_a_lost_pod(kube: Kube, name: str) -> float:
    """Delete the pod of a one-pod model; seconds until the operator has counted the restart, replaced
    the pod and the model is Ready again."""
    restarts = kube.model(name)["status"].get("restarts", 0)
    lost = kube.pods(name)[0]["metadata"]["name"]
    started = time.monotonic()
    kube.kubectl("delete", "pod", lost, "-n", kube.ns, "--wait=false")

    def back() -> bool:
        sm = ready(kube, name, 1)()
        return bool(sm) and sm["status"].get("restarts", 0) > restarts \
            and all(g["phase"] == "Ready" for g in sm["status"]["groups"]) \
            and lost not in {p["metadata"]["name"] for p in kube.pods(name)}
    wait(back, 60, f"{name}'s lost pod {lost} replaced", interval=0.2)
    return time.monotonic() - started


def test_new_layout_rolls_replica_by_replica_keeping_one_serving(kube, operator):
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n{i}", f"{ns}-rack-{i % 2}") for i in range(4)])
    model(kube, "roll", tensor=4, pipeline=2, replicas=2)
    wait(ready(kube, "roll", 2), 90, "roll Ready on TP=4 x PP=2")
    kube.kubectl("patch", "sm", "roll", "-n", ns, "--type=merge",
                 "-p", json.dumps({"spec": {"parallelism": {"tensor": 8, "pipeline": 1}}}))
    # Sample while it rolls: some replica serves at every moment.
    serving, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        st = kube.model("roll").get("status", {})
        serving.append(st.get("readyReplicas", 0))
        if st.get("tensor") == 8 and st.get("phase") == "Ready" and st.get("readyReplicas") == 2 \
                and all(g["phase"] == "Ready" for g in st.get("groups", [])):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"roll did not finish: {kube.model('roll').get('status')}")
    assert min(serving) >= 1, serving
    wait(lambda: len(kube.pods("roll")) == 2, 60, "old pods gone")
    for pod in kube.pods("roll"):
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    events = [e["reason"] for e in kube.get("events")["items"] if e["involvedObject"].get("name") == "roll"]
    assert "LayoutChanged" in events and events.count("Rolling") >= 2
    assert kube.model("roll")["status"]["restarts"] == 0


def _roll_and_sample(kube: Kube, name: str, patch: dict, done, timeout: float = 120) -> list[int]:
    """Patch the model, then sample readyReplicas until `done(status)`; the samples."""
    kube.kubectl("patch", "sm", name, "-n", kube.ns, "--type=merge", "-p", json.dumps({"spec": patch}))
    serving, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = kube.model(name).get("status", {})
        serving.append(st.get("readyReplicas", 0))
        if st.get("phase") == "Ready" and st.get("readyReplicas") == 2 and done(st) \
                and all(g["phase"] == "Ready" for g in st.get("groups", [])):
            return serving
        time.sleep(0.3)
    raise AssertionError(f"{name} did not finish rolling to {patch}: {kube.model(name).get('status')}")


def test_a_full_cluster_rolls_to_a_new_image_and_a_new_layout_keeping_one_replica_serving(kube, operator):
    """No spare GPU anywhere: each of the two replicas fills a node. A successor cannot start beside
    its predecessor, so the roll takes one replica down, starts its successor on the freed GPUs and
    only then moves to the next; it never waits for capacity the old replicas hold."""
    ns = kube.ns
    kube.add_nodes([(f"{ns}-n{i}", f"{ns}-rack-{i}") for i in range(2)])
    model(kube, "full", tensor=8, pipeline=1, replicas=2)
    wait(ready(kube, "full", 2), 90, "full Ready on TP=8, both nodes full")

    image = "registry.local/worker:rolled"
    serving = _roll_and_sample(kube, "full", {"image": image}, done=lambda st: all(
        p["spec"]["containers"][0]["image"] == image for p in kube.pods("full")) and len(kube.pods("full")) == 2)
    assert min(serving) >= 1, serving

    serving = _roll_and_sample(kube, "full", {"parallelism": {"tensor": 4, "pipeline": 2}},
                               done=lambda st: st.get("tensor") == 4 and len(kube.pods("full")) == 4)
    assert min(serving) >= 1, serving
    for pod in kube.pods("full"):
        assert pod["spec"]["containers"][0]["image"] == image
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    events = [e["reason"] for e in kube.get("events")["items"] if e["involvedObject"].get("name") == "full"]
    assert events.count("Rolling") >= 4, events
    assert kube.model("full")["status"]["restarts"] == 0
