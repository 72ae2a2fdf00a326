"""spec.model.prePull: a group's pods wait until one short-lived pod per planned node has filled that
node's cache, and never wait on a pre-pull that failed (no cluster: the decide() harness of
test_decide.py, playing the kubelets' part for the pre-pull pods too)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from shardwise.crds import names
from shardwise.crds.models import ShardedModel, ShardedModelSpec
from shardwise.operator.decide import decisions
from shardwise.operator.render import prepull, renderer
from shardwise.operator.render.settings import Settings
from tests.operator.test_decide import LLAMA_8B, Cluster, rack

URI = "s3://models/llama-8b"


def spec(pre_pull=True, replicas=1, tensor=8, pipeline=2, **model) -> dict:
    return {"model": {**LLAMA_8B, "uri": URI, "endpoint": "http://minio.store:9000", "pathStyle": True,
                      "credentialsRef": {"name": "store-creds"}, "prePull": pre_pull, **model},
            "parallelism": {"tensor": tensor, "pipeline": pipeline, "replicas": replicas},
            "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}


class PrePullCluster(Cluster):
    """The harness, creating the pre-pull pods the actions ask for."""

    def _run(self, action, state) -> None:
        if isinstance(action, decisions.CreatePrePull):
            for node in action.nodes:
                pod = prepull.render(state.model, action.plan, action.replica, action.attempt, node, "img:1")
                self.pods.setdefault(pod["metadata"]["name"], {**pod, "status": {"phase": "Pending"}})
        else:
            super()._run(action, state)

    def replica_pods(self, replica=None):
        return [p for p in super().replica_pods(replica) if not prepull.is_prepull(p)]

    def prepull_pods(self) -> list[dict]:
        return sorted((p for p in self.pods.values() if prepull.is_prepull(p)), key=lambda p: p["spec"]["nodeName"])

    def finish(self, pod: dict, phase: str = "Succeeded", message: str = "") -> None:
        pod["status"] = {"phase": phase, "containerStatuses": [
            {"state": {"terminated": {"exitCode": 0 if phase == "Succeeded" else 1, "message": message}}}]}


def test_the_group_waits_for_every_node_to_pre_pull_then_starts_and_the_pods_are_cleaned_up():
    c = PrePullCluster(spec(), rack("n0 n1", "a"))
    d = c.reconcile()
    assert [type(a).__name__ for a in d.actions] == ["ApplyShared", "SaveGroups", "CreatePrePull"]
    assert not c.replica_pods() and [p["spec"]["nodeName"] for p in c.prepull_pods()] == ["n0", "n1"]
    assert "PrePulling" in c.reasons() and d.prepulling        # the planned GPUs stay reserved
    assert c.condition("PrePulling")["status"] == "True"
    assert "pre-pulling on 0 of 2 node(s) done" in c.status["message"]
    for pod in c.prepull_pods():
        pod["status"] = {"phase": "Running"}
    c.reconcile()
    c.finish(c.prepull_pods()[0])
    d = c.reconcile()
    assert not c.replica_pods() and not any(isinstance(a, decisions.CreatePrePull) for a in d.actions)
    assert "1 of 2 node(s) done" in c.condition("PrePulling")["message"]
    c.finish(c.prepull_pods()[1])
    d = c.reconcile()
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("CreatePods") < kinds.index("DeletePods")   # pre-pulls go only once the pods exist
    assert len(c.replica_pods()) == 2 and not c.prepull_pods()
    assert "PrePulled" in c.reasons() and c.condition("PrePulling")["status"] == "False"
    assert c.status["nodeCache"]["nodes"] == ["n1", "n0"]         # seen filled by the pre-pulls, newest first
    c.ready(replicas=1)


def test_a_failed_or_stuck_pre_pull_never_blocks_the_pods_and_says_so():
    c = PrePullCluster(spec(pipeline=2), rack("n0 n1", "a"))
    c.reconcile()
    first, second = c.prepull_pods()
    c.finish(first, "Failed", "fetching...\nshardwise fetch: error: s3://models/llama-8b: AccessDenied")
    second["metadata"]["creationTimestamp"] = "2026-01-01T11:00:00Z"   # an hour ago: past the deadline
    second["status"] = {"phase": "Pending"}
    c.reconcile()
    assert len(c.replica_pods()) == 2 and not c.prepull_pods()
    warning = next(e for e in c.events if e.reason == "PrePullFailed")
    assert warning.type == "Warning" and "AccessDenied" in warning.message and "not done after" in warning.message
    assert "creating its pods anyway" in warning.message
    assert c.status.get("nodeCache", {}).get("nodes", []) == []    # nothing was seen in a cache


def test_a_pre_pull_on_a_node_that_went_away_is_given_up_at_once():
    c = PrePullCluster(spec(pipeline=1, tensor=8), rack("n0", "a"))
    c.reconcile()
    c.node_down("n0")
    c.reconcile()
    assert "PrePullFailed" in c.reasons() and not c.prepull_pods()


def test_turning_pre_pull_off_releases_the_waiting_group_and_deletes_its_pre_pull_pods():
    c = PrePullCluster(spec(), rack("n0 n1", "a"))
    c.reconcile()
    c.edit(model={**c.body["spec"]["model"], "prePull": False})
    c.reconcile()
    assert len(c.replica_pods()) == 2 and not c.prepull_pods()


def test_a_training_job_s_replicas_are_released_together():
    job = {**spec(replicas=2, tensor=8, pipeline=1), "workload": "training",
           "training": {"data": "/data/text.txt", "steps": 10}, "checkpoint": {"claim": "ckpt"}}
    c = PrePullCluster(job, rack("n0 n1", "a"))
    c.reconcile()
    c.finish(c.prepull_pods()[0])
    c.reconcile()
    assert not c.replica_pods()
    c.finish(c.prepull_pods()[1])
    c.reconcile()
    assert len(c.replica_pods()) == 2


# --- the pre-pull pod ---------------------------------------------------------------------------------

SETTINGS = Settings(model_cache_host_path="/var/lib/shardwise/model-cache", model_cache_budget=100 << 30)


def _model(**model) -> ShardedModel:
    return ShardedModel(metadata={"name": "m", "namespace": "team-a", "uid": "u-1"},
                        spec=ShardedModelSpec.model_validate({**spec(**model), "image": "tenant/image:1"}))


def test_the_pre_pull_pod_fetches_each_stage_share_on_its_node_as_the_worker_pods_would():
    model = _model(fetchStreams=4, tensor=4)
    plan_spec = model.spec.model_copy(update={"parallelism": model.spec.parallelism.model_copy(update={"pipeline": 3})})
    from shardwise.crds.modelshape import from_hints
    from shardwise.operator.planning import groups as planning
    from tests.operator.builders import k8s_node
    plan = planning.plan_groups(plan_spec, from_hints(plan_spec.model), "team-a", "m",
                                {"big": k8s_node("big", gpus=8), "small": k8s_node("small", gpus=4)}, [], [0], None, [])
    by_node = {}
    for p in plan.stages_of(0):
        by_node.setdefault(p.node, []).append(p)
    node = max(by_node, key=lambda n: len(by_node[n]))
    pod = prepull.render(model, plan, 0, 3, node, "operator/worker:2", SETTINGS)
    worker = renderer.render_pod(model, plan, by_node[node][0], 3, "operator/worker:2", SETTINGS)
    s = pod["spec"]
    assert s["nodeName"] == node and s["restartPolicy"] == "Never" and s["activeDeadlineSeconds"] == prepull.DEADLINE_SECONDS
    assert s["automountServiceAccountToken"] is False
    assert [c["name"] for c in s["containers"]] == [f"stage-{p.stage}" for p in by_node[node]]
    first = s["containers"][0]
    p = by_node[node][0]
    assert first["image"] == "operator/worker:2"                     # the operator's image, not spec.image
    assert first["command"] == ["shardwise", "fetch", URI, "--cache", names.MODEL_CACHE_MOUNT, "--budget-gib", "100.0",
                                "--stage", str(p.stage), "--pipeline", "3", "--layers", f"{p.layer_start}:{p.layer_end}",
                                "--endpoint=http://minio.store:9000", "--path-style", "--streams", "4"]
    assert not any(names.LABEL_STAGE in k for k in pod["metadata"]["labels"])
    assert "nvidia.com/gpu" not in str(first["resources"])
    # the worker pod's cache, credentials and security, nothing else of it
    assert s["volumes"] == [v for v in worker["spec"]["volumes"] if v["name"] == "model-cache"]
    assert first["volumeMounts"] == [m for m in worker["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model-cache"]
    assert first["env"] == [e for e in worker["spec"]["containers"][0]["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert {e["name"] for e in first["env"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert s["securityContext"] == worker["spec"]["securityContext"]
    assert first["securityContext"] == worker["spec"]["containers"][0]["securityContext"]
    assert s["initContainers"] == worker["spec"]["initContainers"]   # the cache directory handed to the group
    assert len(pod["metadata"]["name"]) <= 253 and pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_pre_pull_is_refused_where_it_cannot_warm_a_node_cache_and_restarts_nothing():
    with pytest.raises(ValidationError, match="model.prePull is for hf://, s3:// and oci://"):
        ShardedModelSpec.model_validate({"model": {"uri": "/models/x", "prePull": True}})
    with pytest.raises(ValidationError, match="cannot go with model.cache pod"):
        ShardedModelSpec.model_validate({"model": {"uri": URI, "prePull": True, "cache": "pod"}})
    on, off = _model(pre_pull=True), _model(pre_pull=False)
    assert renderer.spec_hash(on.spec) == renderer.spec_hash(off.spec) == renderer.spec_hash(_model(pre_pull=None).spec)
