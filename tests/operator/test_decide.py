"""decide(): every transition of the reconciler, in seconds, with no cluster.

Each test drives one ShardedModel through passes of observe -> decide -> act -> report with the real
state parser, planner, renderer and status builder. What the API server would hold (the model's spec
and status, its pods, its plan ConfigMap) is kept in a `Cluster` of plain objects, and the test plays
the kubelets' part: it binds pods, makes them Ready, fails them, takes nodes away.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime, timedelta, timezone

import pytest

from shardwise.crds import names
from shardwise.crds.models import GroupPhase
from shardwise.operator.decide import decisions
from shardwise.operator.decide import probe
from shardwise.operator.render import renderer
from shardwise.operator.controller import modelroot, report
from shardwise.operator.decide import status
from shardwise.operator.decide.decisions import World
from shardwise.operator.decide.state import parse_state
from tests.operator.builders import RACK
from tests.operator.builders import k8s_node as node

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
LLAMA_8B = {"uri": "/models/llama-8b", "parameters": 8_000_000_000, "layers": 32, "heads": 32, "kvHeads": 8,
            "hiddenSize": 4096, "vocabSize": 128256}


class Cluster:
    """What the API server holds for one model, and the passes of the reconciler over it."""

    def __init__(self, spec: dict, nodes: list[dict], name: str = "m", namespace: str = "ns", model_root: str = ""):
        self.body = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel",
                     "metadata": {"name": name, "namespace": namespace, "uid": "u-1", "generation": 1},
                     "spec": spec, "status": {}}
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.pods: dict[str, dict] = {}
        self.configmap: dict | None = None
        self.now = T0
        self.events: list[decisions.Event] = []
        self.decision: decisions.Decision | None = None
        self.read_model = functools.partial(modelroot.read, root=model_root)

    # --- the reconciler's pass -----------------------------------------------------------------
    def reconcile(self, seconds: float = 1.0) -> decisions.Decision:
        self.now += timedelta(seconds=seconds)
        state = parse_state(self.body, list(self.pods.values()), self.configmap, "img:1", self.read_model)
        d = decisions.decide(state, World(self.nodes, self._gpu_pods()), self.now)
        for action in d.actions:
            self._run(action, state)
        new = status.build_status(state, d, {}, self.now)
        event = status.phase_event(state, new)
        self.body["status"] = {k: v for k, v in {**self.body["status"], **new}.items() if v is not None}
        self.events += d.events + ([event] if event else [])
        self.decision = d
        return d

    def _run(self, action, state) -> None:
        if isinstance(action, decisions.DeleteGroup):
            for key in [k for k, p in self.pods.items()
                        if p["metadata"]["labels"].get(names.LABEL_REPLICA) == str(action.replica)]:
                del self.pods[key]
        elif isinstance(action, decisions.DeletePods):
            for name in action.names:
                self.pods.pop(name, None)
        elif isinstance(action, decisions.ApplyShared):
            self.configmap = next(o for o in renderer.render_shared(state.model, action.plan)
                                  if o["kind"] == "ConfigMap")
        elif isinstance(action, decisions.SaveGroups):
            self.body["status"]["groups"] = [g.to_api() for g in action.groups]
        elif isinstance(action, decisions.CreatePods):
            for pod in renderer.render_replica_pods(state.model, action.plan, action.replica, action.attempt,
                                                    "img:1"):
                if action.stages is None or int(pod["metadata"]["labels"][names.LABEL_STAGE]) in action.stages:
                    self.pods.setdefault(pod["metadata"]["name"], {**pod, "status": {"phase": "Pending"}})
        elif isinstance(action, decisions.CreateProbe):
            pod = probe.render(state.model, "img:1")
            self.pods[pod["metadata"]["name"]] = {**pod, "status": {"phase": "Pending"}}

    def _gpu_pods(self) -> list[dict]:
        return [p for p in self.pods.values() if not probe.is_probe(p)]

    # --- the user's part ---------------------------------------------------------------------------
    def edit(self, **spec) -> None:
        self.body["spec"] = {**self.body["spec"], **spec}
        self.body["metadata"]["generation"] += 1

    # --- the kubelets' part ------------------------------------------------------------------------
    def run_all(self) -> None:
        """Every pending pod is bound to its planned node and Ready."""
        for p in self.replica_pods():
            if p["status"]["phase"] == "Pending":
                p["spec"]["nodeName"] = p["metadata"]["annotations"][names.ANNOTATION_PLANNED_NODE]
                p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}

    def finish_all(self, message: str = "") -> None:
        for p in self.replica_pods():
            p["status"] = {"phase": "Succeeded", "containerStatuses": [
                {"state": {"terminated": {"exitCode": 0, "message": message}}}]}

    def fail(self, pod_name: str, message: str = "boom") -> None:
        self.pods[pod_name]["status"] = {"phase": "Failed", "reason": "Error", "message": message}

    def node_down(self, name: str) -> None:
        self.nodes[name] = node(name, self.nodes[name]["metadata"]["labels"][RACK], ready=False)

    # --- what a user sees --------------------------------------------------------------------------
    @property
    def status(self) -> dict:
        return self.body["status"]

    def replica_pods(self, replica: int | None = None) -> list[dict]:
        return [p for p in self.pods.values() if not probe.is_probe(p) and (
            replica is None or p["metadata"]["labels"][names.LABEL_REPLICA] == str(replica))]

    def group(self, replica: int) -> dict:
        return next(g for g in self.status["groups"] if g["replica"] == replica)

    def condition(self, type_: str) -> dict:
        return next(c for c in self.status["conditions"] if c["type"] == type_)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def nodes_of(self, replica: int) -> list[str]:
        return [p["spec"].get("nodeName") or p["metadata"]["annotations"][names.ANNOTATION_PLANNED_NODE]
                for p in sorted(self.replica_pods(replica), key=lambda p: p["metadata"]["labels"][names.LABEL_STAGE])]

    def ready(self, replicas: int | None = None) -> None:
        """Passes until the model is Ready, pods starting as they are created."""
        for _ in range(6):
            self.reconcile()
            self.run_all()
            self.reconcile()
            if self.status["phase"] in ("Ready", "Running"):
                break
        assert self.status["phase"] in ("Ready", "Running"), self.status.get("message")
        if replicas is not None:
            assert self.status["readyReplicas"] == replicas


def serving(tensor=4, pipeline=2, replicas=1, **extra) -> dict:
    return {"model": dict(LLAMA_8B), "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": replicas},
            "recovery": {"backoffSeconds": 4, "maxRestarts": 2}, **extra}


def training(replicas=2, steps=100) -> dict:
    return {**serving(tensor=4, pipeline=1, replicas=replicas), "workload": "training",
            "training": {"data": "/data/text.txt", "steps": steps},
            "checkpoint": {"claim": "ckpt"}}


def rack(names: str, rack_name: str, gpus: int = 8) -> list[dict]:
    return [node(n, rack_name, gpus) for n in names.split()]


# --- serving: create, ready, recover ---------------------------------------------------------------

def test_a_new_model_is_planned_stored_created_and_ready():
    c = Cluster(serving(), rack("n0 n1", "a"))
    d = c.reconcile()
    kinds = [type(a).__name__ for a in d.actions]
    # the plan is stored before the records, and both before the pods that read them
    assert kinds == ["ApplyShared", "SaveGroups", "CreatePods"]
    assert c.group(0)["phase"] == "Creating" and c.group(0)["attempt"] == 1
    assert len(c.replica_pods(0)) == 2 and c.status["phase"] == "Starting"
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Ready" and c.status["readyReplicas"] == 1 and c.status["readyShards"] == 2
    assert c.condition("Ready")["status"] == "True" and c.condition("Planned")["status"] == "True"
    assert c.status["endpoint"].startswith("http://m.ns.svc")
    assert [p["layers"] for p in c.status["plan"]["placements"]] == ["0-15", "16-31"] or \
        len(c.status["plan"]["placements"]) == 2
    # a steady pass does nothing
    assert c.reconcile().actions == []


def test_the_plan_the_pods_read_is_the_plan_decided():
    c = Cluster(serving(replicas=2), rack("n0 n1 n2 n3", "a"))
    d = c.reconcile()
    stored = renderer.plan_from_configmap(c.configmap)
    assert stored == d.plan and stored.placements and stored.memory_per_gpu > 0
    # and a later pass reasons about exactly that plan, not a summary of it
    state = parse_state(c.body, list(c.pods.values()), c.configmap, "img:1")
    assert state.plan == d.plan


def test_a_lost_node_tears_the_group_down_backs_off_and_replans_elsewhere():
    c = Cluster(serving(), rack("n0 n1", "a") + rack("n2 n3", "b"))
    c.ready()
    lost = c.nodes_of(0)[1]
    c.node_down(lost)
    d = c.reconcile()
    assert isinstance(d.actions[0], decisions.DeleteGroup) and d.actions[0].force   # its kubelet won't answer
    assert d.recoveries == ["node-not-ready"]                                       # the metric's cause
    assert c.group(0)["phase"] == "Recovering" and c.group(0)["restarts"] == 1 and not c.replica_pods(0)
    assert c.status["phase"] == "Recovering" and "NotReady" in c.condition("Recovering")["message"]
    assert "Recovering" in c.reasons()
    c.reconcile(seconds=1)           # backoff (4s) not over: nothing
    assert c.group(0)["phase"] == "Recovering" and not c.replica_pods(0)
    c.reconcile(seconds=4)
    assert c.group(0)["phase"] == "Creating" and c.group(0)["attempt"] == 2
    assert lost not in c.nodes_of(0)
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Ready" and "Recovered" in c.reasons()
    assert c.decision.recovered and c.status["restarts"] == 1


def test_a_failed_pod_fails_its_group_and_the_budget_ends_in_failed_then_a_spec_change_reopens_it():
    c = Cluster(serving(tensor=8, pipeline=1), rack("n0 n1", "a"))
    c.ready()
    for restart in (1, 2, 3):
        c.fail(c.replica_pods(0)[0]["metadata"]["name"], "CUDA error")
        c.reconcile(seconds=400)
        if restart <= 2:
            assert c.group(0)["phase"] == "Recovering"
            c.reconcile(seconds=400)
            c.run_all()
            c.reconcile()
    assert c.group(0)["phase"] == "Failed" and c.status["phase"] == "Failed"
    assert "RestartBudgetExhausted" in c.reasons() and "CUDA error" in c.status["message"]
    assert c.reconcile().actions == []          # terminal: nothing is retried
    c.edit(recovery={"backoffSeconds": 0, "maxRestarts": 5})
    c.reconcile()
    assert c.group(0)["phase"] == "Creating" and c.group(0)["restarts"] == 0


def test_one_replica_out_of_budget_leaves_the_model_degraded_not_failed():
    c = Cluster(serving(tensor=8, pipeline=1, replicas=2, recovery={"backoffSeconds": 0, "maxRestarts": 0}),
                rack("n0 n1", "a"))
    c.ready(2)
    c.fail(c.replica_pods(1)[0]["metadata"]["name"])
    c.reconcile()
    assert c.group(1)["phase"] == "Failed" and c.group(0)["phase"] == "Ready"
    assert c.status["phase"] == "Degraded" and c.status["readyReplicas"] == 1


def test_a_pod_unschedulable_past_the_grace_replans_its_group():
    c = Cluster(serving(tensor=8, pipeline=1), rack("n0 n1", "a"))
    c.reconcile()
    pod = c.replica_pods(0)[0]
    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 nodes are available: insufficient nvidia.com/gpu",
         "lastTransitionTime": (c.now).isoformat()}]}
    c.reconcile(seconds=1)
    assert c.condition("PodsScheduled")["status"] == "False" and "insufficient" in \
        c.condition("PodsScheduled")["message"]
    c.reconcile(seconds=20)
    assert c.group(0)["restarts"] == 1 and "cannot be scheduled" in c.group(0)["lastFailure"]


def test_pods_of_an_older_attempt_are_removed():
    c = Cluster(serving(tensor=8, pipeline=1), rack("n0 n1", "a"))
    c.ready()
    old = dict(c.replica_pods(0)[0])
    old = json.loads(json.dumps(old))
    old["metadata"]["name"] = "m-r0-s0-a0"
    old["metadata"]["labels"][names.LABEL_ATTEMPT] = "0"
    c.pods["m-r0-s0-a0"] = old
    d = c.reconcile()
    assert decisions.DeletePods(("m-r0-s0-a0",), force=True) in d.actions


# --- serving: scaling, rolling ------------------------------------------------------------------

def test_scale_up_plans_only_the_new_replica_and_scale_down_forgets_it():
    c = Cluster(serving(tensor=8, pipeline=1), rack("n0 n1 n2", "a"))
    c.ready(1)
    first = c.replica_pods(0)[0]["metadata"]["name"]
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 3})
    c.ready(3)
    assert first in c.pods, "the running replica was left alone"
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 1})
    c.reconcile()
    assert "ScaledDown" in c.reasons() and len(c.replica_pods()) == 1
    assert {p.replica for p in renderer.plan_from_configmap(c.configmap).placements} == {0}
    c.reconcile()
    assert c.reasons().count("ScaledDown") == 1, "the stored plan forgot the removed replicas"


def test_a_new_layout_rolls_one_replica_at_a_time_keeping_one_serving():
    c = Cluster(serving(tensor=4, pipeline=2, replicas=2), rack("n0 n1 n2 n3", "a"))
    c.ready(2)
    c.edit(parallelism={"tensor": 8, "pipeline": 1, "replicas": 2})
    serving_counts = []
    for _ in range(12):
        c.reconcile()
        serving_counts.append(c.status["readyReplicas"])
        c.run_all()
        c.reconcile()
        serving_counts.append(c.status["readyReplicas"])
        if c.status.get("tensor") == 8 and all(g["phase"] == "Ready" for g in c.status["groups"]) \
                and c.status["phase"] == "Ready":
            break
    assert c.status["tensor"] == 8 and c.status["phase"] == "Ready"
    assert min(serving_counts) >= 1
    assert "LayoutChanged" in c.reasons() and c.reasons().count("Rolling") == 2
    assert c.reasons().count("LayoutChanged") == 1
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
               for p in c.replica_pods())
    assert c.status["restarts"] == 0


def test_a_new_image_replaces_replicas_one_at_a_time():
    c = Cluster(serving(tensor=8, pipeline=1, replicas=2), rack("n0 n1", "a"))
    c.ready(2)
    old = {p["metadata"]["labels"][names.LABEL_SPEC_HASH] for p in c.replica_pods()}
    c.edit(image="img:2")
    c.reconcile()
    assert c.reasons().count("Rolling") == 1 and c.status["readyReplicas"] == 1
    for _ in range(6):
        c.run_all()
        c.reconcile()
    new = {p["metadata"]["labels"][names.LABEL_SPEC_HASH] for p in c.replica_pods()}
    assert c.reasons().count("Rolling") == 2 and new.isdisjoint(old) and c.status["phase"] == "Ready"


# --- planning failures --------------------------------------------------------------------------

def test_short_of_capacity_waits_pending_and_plans_when_a_node_arrives():
    c = Cluster(serving(tensor=16, pipeline=1, model={**LLAMA_8B, "kvHeads": 16}), rack("n0", "a"))
    c.reconcile()
    assert c.status["phase"] == "Pending" and c.condition("Planned")["reason"] == "NoFeasiblePlan"
    assert "16 GPUs" in c.condition("Planned")["message"] and not c.replica_pods()
    assert c.decision.requeue_after == 2 * decisions.NOT_READY_REQUEUE
    c.nodes["big"] = node("big", "a", gpus=16)
    c.ready()


def test_a_layout_the_model_cannot_take_is_an_invalid_spec_not_a_wait(tmp_path):
    # the heads are in the model's own config, which the schema cannot see but the operator reads
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 24, "num_key_value_heads": 12, "hidden_size": 768,
        "vocab_size": 1000, "intermediate_size": 2048}))
    c = Cluster(serving(tensor=8, pipeline=1, model={"uri": str(tmp_path)}), rack("n0", "a"),
                model_root=str(tmp_path))   # the operator reads models inside its model root only
    c.reconcile()
    assert c.status["phase"] == "Failed" and c.condition("Planned")["reason"] == "InvalidSpec"
    assert "does not divide" in c.condition("Planned")["message"]
    c.reconcile()
    assert c.reasons().count("InvalidSpec") == 1, "told once, not every pass"


def test_a_spec_the_api_would_refuse_ends_in_one_condition():
    c = Cluster({"model": {"uri": "/m"}, "parallelism": {"tensor": 0}}, rack("n0", "a"))
    c.reconcile()
    assert c.status["phase"] == "Failed" and "parallelism.tensor" in c.status["message"]
    assert c.reasons() == ["InvalidSpec"]


def test_a_model_named_before_the_api_checked_names_ends_in_one_condition_and_makes_nothing():
    from shardwise.crds.models import NAME_NOT_DNS_LABEL
    c = Cluster(serving(), rack("n0 n1", "a"), name="8b.chat")
    c.reconcile()
    assert c.status["phase"] == "Failed" and c.status["message"] == NAME_NOT_DNS_LABEL
    assert not c.pods and c.configmap is None


def test_a_model_nobody_can_read_fails_with_its_path():
    c = Cluster(serving(model={"uri": "/nowhere/model"}), rack("n0 n1", "a"), model_root="/")
    c.reconcile()
    assert c.status["phase"] == "Failed" and "/nowhere/model" in c.condition("Planned")["message"]


# --- pvc:// models: the probe --------------------------------------------------------------------

def _facts_json() -> str:
    from shardwise.crds.modelshape import from_hints
    from shardwise.crds.models import ModelSource
    return json.dumps(from_hints(ModelSource.model_validate(LLAMA_8B)).to_dict())


def test_a_pvc_model_without_hints_is_probed_once_and_then_planned():
    c = Cluster(serving(model={"uri": "pvc://weights/llama"}), rack("n0 n1", "a"))
    d = c.reconcile()
    assert d.actions == [decisions.CreateProbe()] and c.group(0)["phase"] == "Pending"
    assert "reading the model's shape" in c.status["message"]
    [pod] = [p for p in c.pods.values() if probe.is_probe(p)]
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert c.reconcile().actions == [], "one probe, not one per pass"
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": _facts_json()}}}]}
    d = c.reconcile()
    assert decisions.DeletePods((pod["metadata"]["name"],)) in d.actions and c.replica_pods(0)
    assert c.status["modelFacts"]["uri"] == "pvc://weights/llama" and c.status["modelFacts"]["facts"]
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Ready"
    # a later re-plan uses the cached facts: no second probe
    c.node_down(c.nodes_of(0)[0])
    c.reconcile(seconds=10)
    c.reconcile(seconds=10)
    assert not [p for p in c.pods.values() if probe.is_probe(p)]


def test_a_pvc_model_the_probe_cannot_read_fails_with_the_probes_reason():
    c = Cluster(serving(model={"uri": "pvc://weights/nothing-here"}), rack("n0", "a"))
    c.reconcile()
    [pod] = [p for p in c.pods.values() if probe.is_probe(p)]
    pod["status"] = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
        "exitCode": 2, "message": "shardwise inspect: /models/weights/nothing-here: no such file"}}}]}
    c.reconcile()
    assert c.status["phase"] == "Failed" and "no such file" in c.condition("Planned")["message"]
    assert c.reconcile().actions == [], "not probed again until the spec changes"


def _probes(c: Cluster) -> list[dict]:
    return [p for p in c.pods.values() if probe.is_probe(p)]


def _probe_failed(pod: dict, exit_code: int, message: str, reason: str = "Error") -> None:
    pod["status"] = {"phase": "Failed", "reason": reason, "containerStatuses": [{"state": {"terminated": {
        "exitCode": exit_code, "message": message}}}]}


def test_a_store_that_cannot_be_reached_is_read_again_with_a_backoff_never_failing_the_spec():
    # one moment when a node's pods cannot reach the registry (a restarted node) must not fail the
    # model for good: `shardwise inspect` exits EXIT_UNREACHABLE, and the operator tries again later
    c = Cluster(serving(model={"uri": "oci://registry.example:5000/models/llama:v1"}), rack("n0 n1", "a"))
    c.reconcile()
    unreachable = "shardwise inspect: oci://registry.example:5000/models/llama:v1: cannot reach the registry (ConnectError)"
    waits = []
    for failures in (1, 2, 3):
        [pod] = _probes(c)
        _probe_failed(pod, names.EXIT_UNREACHABLE, unreachable)
        c.reconcile()
        assert c.status["phase"] == "Pending" and c.group(0)["phase"] == "Pending"
        assert "InvalidSpec" not in c.reasons() and c.reasons().count("ModelUnreachable") == failures
        facts = c.status["modelFacts"]
        assert facts["unreachable"].endswith("cannot reach the registry (ConnectError)") and "error" not in facts
        assert facts["failures"] == failures
        assert f"reading the model again at {facts['retryAt']} ({failures} in a row): cannot" in c.status["message"]
        waited = 0
        while not _probes(c):
            c.reconcile(seconds=1)
            waited += 1
            assert waited < 400
        waits.append(waited)
    assert waits == [5, 10, 20], "5 s, doubled per failure in a row"
    c.reconcile()
    assert "reading the model's shape from oci://registry.example:5000/models/llama:v1 again" in c.status["message"]
    [pod] = _probes(c)
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": _facts_json()}}}]}
    c.reconcile()
    assert c.status["modelFacts"].get("facts") and "unreachable" not in c.status["modelFacts"]
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Ready"


def test_the_probes_backoff_is_capped_and_a_changed_spec_reads_at_once():
    assert [probe.retry_delay(n) for n in (1, 2, 3, 7, 50)] == [5, 10, 20, 300, 300]
    c = Cluster(serving(model={"uri": "s3://models/llama"}), rack("n0", "a"))
    c.reconcile()
    [pod] = _probes(c)     # a pod out of its deadline (a stalled store) is a transient failure too
    pod["status"] = {"phase": "Failed", "reason": "DeadlineExceeded", "message": "Pod was active too long"}
    c.reconcile()
    assert c.status["modelFacts"]["failures"] == 1 and not _probes(c) and c.status["phase"] == "Pending"
    c.edit(model={"uri": "s3://models/llama", "endpoint": "http://other-store:9000"})
    c.reconcile()
    assert len(_probes(c)) == 1, "the new spec is read without waiting out the old one's backoff"


def test_a_probe_that_reports_deeply_nested_json_fails_with_one_line():
    # a probe pod writes its own termination message: 4,000 "[" made the parser raise RecursionError
    c = Cluster(serving(model={"uri": "pvc://weights/deep"}), rack("n0", "a"))
    c.reconcile()
    [pod] = [p for p in c.pods.values() if probe.is_probe(p)]
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {
        "exitCode": 0, "message": "[" * 4000}}}]}
    c.reconcile()
    message = c.condition("Planned")["message"]
    assert c.status["phase"] == "Failed" and "nests deeper than" in message and "\n" not in message


def test_hints_override_the_probe():
    c = Cluster(serving(model={**LLAMA_8B, "uri": "pvc://weights/llama"}), rack("n0 n1", "a"))
    c.reconcile()
    assert not [p for p in c.pods.values() if probe.is_probe(p)] and c.replica_pods(0)


# --- training: a gang ----------------------------------------------------------------------------

def test_a_training_job_is_created_whole_with_one_attempt_and_succeeds():
    c = Cluster(training(replicas=2), rack("n0", "a"))
    c.reconcile()
    assert {c.group(r)["attempt"] for r in (0, 1)} == {1} and len(c.replica_pods()) == 2
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Running" and c.status.get("endpoint") is None
    c.finish_all()
    c.reconcile()
    assert c.status["phase"] == "Succeeded" and "Succeeded" in c.reasons()
    assert c.reconcile().actions == []


def test_one_failed_rank_tears_down_the_whole_job_and_counts_one_restart():
    c = Cluster(training(replicas=2), rack("n0", "a") + rack("n1", "b"))
    c.ready()
    c.fail(c.replica_pods(1)[0]["metadata"]["name"], "NCCL timeout")
    c.reconcile()
    assert not c.replica_pods() and {c.group(r)["phase"] for r in (0, 1)} == {"Recovering"}
    told = [e for e in c.events if e.reason == "Recovering" and e.type == "Warning" and "tearing down all" in e.message]
    assert c.status["restarts"] == 1 and len(told) == 1 and "NCCL timeout" in told[0].message
    c.reconcile(seconds=5)
    assert {c.group(r)["attempt"] for r in (0, 1)} == {2} and len(c.replica_pods()) == 2


def test_a_training_job_that_cannot_fit_whole_waits_instead_of_running_short():
    c = Cluster(training(replicas=3), rack("n0", "a"))      # 8 GPUs: two TP=4 replicas fit, not three
    c.reconcile()
    assert not c.replica_pods() and c.status["phase"] == "Pending"
    assert "only 2 such block(s) are free" in c.status["message"]


def test_scaling_a_training_job_restarts_it_whole_and_zero_pauses_it():
    c = Cluster(training(replicas=1), rack("n0", "a"))
    c.ready()
    c.edit(parallelism={"tensor": 4, "pipeline": 1, "replicas": 2})
    c.reconcile()
    assert "Restarting" in c.reasons() and not c.replica_pods()
    c.reconcile()   # the old pods are gone: the job is planned again, whole
    assert {c.group(r)["attempt"] for r in (0, 1)} == {2}
    c.run_all()
    c.reconcile()
    c.edit(parallelism={"tensor": 4, "pipeline": 1, "replicas": 0})
    c.reconcile()
    assert "Paused" in c.reasons() and not c.replica_pods() and c.status["phase"] == "Pending"
    assert [g["replica"] for g in c.status["groups"]] == [0], "replica 0 keeps the attempt count"
    c.edit(parallelism={"tensor": 4, "pipeline": 1, "replicas": 1})
    c.reconcile()
    assert c.group(0)["attempt"] == 3 and c.replica_pods(0)


def test_a_finished_job_asked_for_more_steps_runs_again():
    c = Cluster(training(replicas=1, steps=10), rack("n0", "a"))
    c.ready()
    c.finish_all()
    c.reconcile()
    c.body["status"]["training"] = {"step": 10, "steps": 10}
    assert c.status["phase"] == "Succeeded"
    c.edit(training={"data": "/data/text.txt", "steps": 20})
    c.reconcile()
    assert c.group(0)["phase"] in ("Creating", "Pending") and c.status["phase"] != "Succeeded"


@pytest.mark.parametrize("phase", list(GroupPhase))
def test_every_group_phase_survives_a_status_round_trip(phase):
    c = Cluster(serving(), rack("n0 n1", "a"))
    c.body["status"]["groups"] = [{"replica": 0, "attempt": 1, "phase": phase.value}]
    state = parse_state(c.body, [], None, "img:1")
    assert state.groups[0].phase is phase and state.groups[0].to_api()["phase"] == phase.value


def test_a_new_zero3_shard_degree_restarts_the_job_on_a_new_plan():
    c = Cluster(training(replicas=4), rack("n0 n1", "a"))
    c.ready()
    assert json.loads(renderer.configmap_contract(c.configmap))["plan"]["data_shard"] == 1   # GPUs large enough
    c.edit(training={"data": "/data/text.txt", "steps": 100, "dataParallel": {"shard": 2}})
    c.reconcile()
    told = [e.message for e in c.events if e.reason == "Restarting"]
    assert told and told[-1].startswith("layout changed from TP=4 PP=1 ZeRO-3 shard 1 to TP=4 PP=1 ZeRO-3 shard 2")
    c.reconcile()
    contract = json.loads(renderer.configmap_contract(c.configmap))
    assert contract["plan"]["data_shard"] == 2 and contract["training"]["data_parallel"]["shard"] == 2
    assert {c.group(r)["attempt"] for r in range(4)} == {2} and len(c.replica_pods()) == 4


# --- training: elastic (minReplicas), grow back ------------------------------------------------------

def elastic_job(replicas=2, min_replicas=1, **training_fields) -> dict:
    spec = training(replicas=replicas)
    spec["training"] = {**spec["training"], "minReplicas": min_replicas, **training_fields}
    return spec


def shrunk_to_one() -> Cluster:
    """A 2-replica job (minReplicas 1) on two nodes of 4 GPUs, no spare: n1 lost, it runs on n0 alone."""
    c = Cluster(elastic_job(), rack("n0", "a", gpus=4) + rack("n1", "b", gpus=4))
    c.ready()
    c.node_down("n1")
    c.reconcile()                   # torn down whole, one restart
    c.reconcile(seconds=5)          # backoff over, old pods gone: planned at the size that fits
    c.run_all()
    c.reconcile()
    return c


def test_an_elastic_job_short_of_capacity_runs_with_fewer_replicas_and_says_why():
    c = shrunk_to_one()
    assert c.status["phase"] == "Running" and c.status["replicas"] == 1 and c.status["plan"]["shrunk"]
    assert [g["replica"] for g in c.status["groups"]] == [0] and c.nodes_of(0) == ["n0"]
    shrunk = c.condition("Shrunk")
    assert shrunk["status"] == "True" and shrunk["reason"] == "ShortOfCapacity"
    assert shrunk["message"].startswith("running 1 of 2 replicas (minReplicas 1): "), shrunk["message"]
    assert "running 1 of 2 replicas" in c.status["message"] and "Shrunk" in c.reasons()
    contract = json.loads(renderer.configmap_contract(c.configmap))
    assert contract["plan"]["replicas"] == 1 and contract["training"]["batch_size"] == 8   # the global batch
    assert c.status["restarts"] == 1


def test_an_elastic_job_below_min_replicas_waits_pending():
    c = Cluster(elastic_job(replicas=3, min_replicas=2), rack("n0", "a", gpus=4))
    c.reconcile()
    assert not c.replica_pods() and c.status["phase"] == "Pending"
    assert "nor any size down to minReplicas 2" in c.status["message"]


def test_a_shrunk_job_grows_back_when_capacity_returns_without_counting_a_restart():
    c = shrunk_to_one()
    c.body["status"]["training"] = {"step": 40, "steps": 100}
    c.nodes["n1"] = node("n1", "b", gpus=4)          # back, Ready
    c.reconcile(seconds=5)
    assert "Growing" not in c.reasons(), "a job runs a while at a size before it grows"
    c.reconcile(seconds=decisions.elastic.GROW_AFTER_SECONDS)
    grew = [e.message for e in c.events if e.reason == "Growing"]
    assert grew == [grew[0]] and grew[0].startswith("growing from 1 to 2 replicas at step 40"), grew
    assert not c.replica_pods(), "the old pods are stopped first (they save a checkpoint)"
    attempt = c.group(0)["attempt"]
    c.reconcile()                                     # they are gone: planned at the full size
    c.run_all()
    c.reconcile()
    assert c.status["phase"] == "Running" and c.status["replicas"] == 2 and not c.status["plan"]["shrunk"]
    assert {c.group(r)["attempt"] for r in (0, 1)} == {attempt + 1}
    assert c.status["restarts"] == 1, "growing is no failure: only the node loss counts"
    assert c.condition("Shrunk")["status"] == "False"
    for _ in range(5):                                # no flapping: a whole job stays as it is
        assert c.reconcile(seconds=60).actions == []
    assert [e.reason for e in c.events].count("Growing") == 1 and "Restarting" not in c.reasons()


def test_a_shrunk_job_does_not_grow_while_capacity_is_still_short():
    c = shrunk_to_one()
    for _ in range(4):
        assert c.reconcile(seconds=60).actions == []
    assert "Growing" not in c.reasons() and c.status["replicas"] == 1 and c.status["phase"] == "Running"


def test_a_shrunk_job_keeps_the_asked_shard_degree_dividing_its_replicas():
    # 4 replicas asked, ZeRO-3 over 2: with room for 3, it runs 2 (a multiple of the shard degree).
    c = Cluster(elastic_job(replicas=4, min_replicas=1, dataParallel={"shard": 2}),
                rack("n0", "a", gpus=8) + rack("n1", "b", gpus=4))
    c.nodes["n1"] = node("n1", "b", gpus=4, ready=False)
    c.nodes["n2"] = node("n2", "b", gpus=4)
    c.reconcile()
    plan = json.loads(renderer.configmap_contract(c.configmap))["plan"]
    assert (plan["replicas"], plan["data_shard"]) == (2, 2) and plan["shrunk"]


def test_a_job_without_min_replicas_still_runs_whole_or_waits():
    c = Cluster(training(replicas=3), rack("n0", "a"))
    c.reconcile()
    assert c.status["phase"] == "Pending" and "minReplicas" not in c.status["message"]


def test_metrics_say_checkpoint_age_per_tier_and_replicas_running_vs_asked():
    from shardwise.operator.controller import metrics
    c = shrunk_to_one()
    state_status = {**c.status, "lastCheckpoint": {"step": 40, "time": "2026-01-01T12:00:00.000Z"},
                    "lastLocalCheckpoint": {"step": 50, "time": "2026-01-01T12:00:30.000Z"}}
    state = parse_state({**c.body, "status": state_status}, list(c.pods.values()), c.configmap, "img:1")
    now = datetime(2026, 1, 1, 12, 1, 0, tzinfo=timezone.utc)
    report.record_metrics(state, c.decision, state_status, now)
    value = lambda name, **labels: metrics.REGISTRY.get_sample_value(name, {"namespace": "ns", "model": "m", **labels})
    assert value("shardwise_checkpoint_age_seconds", tier="shared") == 60.0
    assert value("shardwise_checkpoint_age_seconds", tier="local") == 30.0
    assert (value("shardwise_training_replicas_running"), value("shardwise_training_replicas_asked")) == (1.0, 2.0)


def test_a_job_restarting_after_its_peer_failed_first_does_not_wait_for_pods_on_a_lost_node():
    """The surviving rank fails before the node is NotReady: its peer's pod, deleted with a grace
    period, would stay Terminating on a dead kubelet; once the node is NotReady it is force-deleted."""
    c = Cluster(elastic_job(), rack("n0", "a", gpus=4) + rack("n1", "b", gpus=4))
    c.ready()
    survivor, peer = c.replica_pods(0)[0], c.replica_pods(1)[0]
    c.fail(survivor["metadata"]["name"], "a rank exited with code 1")
    c.reconcile()
    stuck = {**peer, "metadata": {**peer["metadata"], "deletionTimestamp": "2026-01-01T12:00:05Z"}}
    c.pods[peer["metadata"]["name"]] = stuck               # Terminating on its dead kubelet
    c.reconcile(seconds=5)
    assert "waiting for the 1 pod(s) of the previous run" in c.status["message"]
    c.node_down("n1")
    d = c.reconcile()
    assert decisions.DeletePods((peer["metadata"]["name"],), force=True) in d.actions
    assert c.status["replicas"] == 1 and [p["metadata"]["name"] for p in c.replica_pods()] == ["m-r0-s0-a2"]
