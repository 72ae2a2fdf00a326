"""Renderer: what a ShardPlan becomes in Kubernetes objects (pure; no cluster)."""
from __future__ import annotations

import json

import base64
import gzip

from shardwise.crds.contract import PodContract
from shardwise.crds.models import ShardedModel, ShardedModelSpec
from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
from shardwise.operator.render import renderer

METADATA = {"name": "llama", "namespace": "prod", "uid": "uid-1", "generation": 3}


def _spec(**spec) -> dict:
    base = {"model": {"uri": "pvc://models/smollm2"}, "parallelism": {"tensor": 2, "pipeline": 2, "replicas": 2},
            "serving": {"port": 8080}}
    base.update(spec)
    return base


def _model(**spec) -> ShardedModel:
    return ShardedModel(metadata=METADATA, spec=ShardedModelSpec.model_validate(_spec(**spec)))


def _contract(configmap: dict) -> PodContract:
    return PodContract.from_json(renderer.configmap_contract(configmap))


def _render(model: ShardedModel, plan: ShardPlan, attempts: dict[int, int] | None = None) -> list[dict]:
    """Every object of the model as the reconciler makes them: the shared ones, then each replica's pods."""
    attempts = attempts or {}
    objects = renderer.render_shared(model, plan)
    for r in sorted({p.replica for p in plan.placements}):
        objects += renderer.render_replica_pods(model, plan, r, attempts.get(r, 0))
    return objects


def _plan(replicas=2, pipeline=2, tensor=2, layers=30):
    placements = []
    for r in range(replicas):
        edge = 0
        for s in range(pipeline):
            end = layers if s == pipeline - 1 else edge + layers // pipeline
            placements.append(StagePlacement(replica=r, stage=s, node=f"node-{r}-{s}", gpus=tensor,
                                             layer_start=edge, layer_end=end, embedding=s == 0,
                                             head=s == pipeline - 1))
            edge = end
    return ShardPlan(tensor=tensor, pipeline=pipeline, replicas=replicas, num_layers=layers,
                     placements=placements, groups=[ReplicaPlan(replica=r) for r in range(replicas)])


def test_one_pod_per_replica_and_stage_pinned_to_its_node_with_tp_gpus():
    plan = _plan()
    objects = _render(_model(), plan)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == 4
    for pod in pods:
        labels = pod["metadata"]["labels"]
        r, s = int(labels["shardwise.dev/replica"]), int(labels["shardwise.dev/stage"])
        assert labels["shardwise.dev/model"] == "llama"
        term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [f"node-{r}-{s}"]
        res = pod["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == "2" == res["limits"]["nvidia.com/gpu"]
        assert pod["spec"]["restartPolicy"] == "Never"
    assert sorted(p["metadata"]["name"] for p in pods) == [
        "llama-r0-s0-a0", "llama-r0-s1-a0", "llama-r1-s0-a0", "llama-r1-s1-a0"]


def test_worker_gets_rendezvous_env_and_command():
    plan = _plan()
    pod = renderer.render_pod(_model(), plan, plan.placement(1, 1), attempt=4)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    # The pod's identity and rendezvous only: everything the pods share is in the contract.
    assert list(env) == ["SHARDWISE_REPLICA", "SHARDWISE_STAGE", "MASTER_ADDR", "MASTER_PORT", "POD_IP", "NODE_NAME"]
    assert env["SHARDWISE_REPLICA"]["value"] == "1" and env["SHARDWISE_STAGE"]["value"] == "1"
    assert env["MASTER_ADDR"]["value"] == "llama-r1-s0.llama-ranks.prod.svc.cluster.local"
    # One rendezvous port per group incarnation, the same for every stage of it.
    port = env["MASTER_PORT"]["value"]
    other_stage = renderer.render_pod(_model(), plan, plan.placement(1, 0), attempt=4)
    assert {e["name"]: e.get("value") for e in other_stage["spec"]["containers"][0]["env"]}["MASTER_PORT"] == port
    assert 20000 <= int(port) < 30000
    assert {"name": "rendezvous", "containerPort": int(port), "protocol": "TCP"} in c["ports"]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["command"] + c["args"] == ["shardwise", "worker", "--contract", "/etc/shardwise/contract.json.gz"]
    assert {"name": "plan", "mountPath": "/etc/shardwise", "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}
    # The pod's DNS name is what MASTER_ADDR of its replica points at (stage 0), stable across attempts.
    assert pod["spec"]["hostname"] == "llama-r1-s1" and pod["spec"]["subdomain"] == "llama-ranks"
    assert pod["metadata"]["name"] == "llama-r1-s1-a4"
    assert pod["metadata"]["labels"]["shardwise.dev/attempt"] == "4"


def test_everything_is_owned_by_the_model():
    objects = _render(_model(), _plan())
    assert {o["kind"] for o in objects} == {"Pod", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"}
    for o in objects:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["kind"] == "ShardedModel" and ref["controller"] is True
        assert o["metadata"]["namespace"] == "prod"


def test_configmap_carries_the_contract_the_worker_validates():
    plan = _plan()
    cm = renderer.render_configmap(_model(), plan)
    contract = _contract(cm)
    assert contract.plan == plan
    assert (contract.model.path, contract.model.format, contract.model.dtype) == ("/models/models/smollm2", "auto", "auto")
    assert contract.workload == "inference" and contract.training is None and contract.checkpoint is None
    assert (contract.serving.port, contract.serving.model_name) == (8080, "llama")
    assert contract.termination_log == "/dev/termination-log"


def test_the_plan_is_read_back_from_the_configmap():
    plan = _plan()
    cm = renderer.render_configmap(_model(), plan)
    assert list(cm["binaryData"]) == ["contract.json.gz"] and "data" not in cm
    assert renderer.plan_from_configmap(cm) == plan

    def stored(data: bytes) -> dict:
        return {**cm, "binaryData": {"contract.json.gz": base64.b64encode(data).decode()}}
    whole = gzip.compress(renderer.configmap_contract(cm))
    assert renderer.plan_from_configmap(stored(whole)) == plan
    bare = stored(gzip.compress(plan.model_dump_json().encode()))   # a bare ShardPlan is no contract
    assert renderer.plan_from_configmap(bare) is None
    for unreadable in (None, {}, {"binaryData": {}}, {"binaryData": {"contract.json.gz": "not base64!"}},
                       stored(b"{not json"), stored(gzip.compress(b"{}")), stored(whole[:-20]),
                       stored(whole + b"trailing"), {"data": {"contract.json": "{not json"}}):
        assert renderer.plan_from_configmap(unreadable) is None


def test_spec_hash_ignores_replicas_recovery_placement_and_written_out_defaults():
    base = renderer.spec_hash(_model().spec)
    assert renderer.spec_hash(_model(parallelism={"tensor": 2, "pipeline": 2, "replicas": 5},
                                    recovery={"maxRestarts": 9}, placement={"nodeSelector": {"a": "b"}}).spec) == base
    # autoscaling only sets the replica count: turning it on or tuning it rolls no pod
    assert renderer.spec_hash(_model(autoscaling={"minReplicas": 1, "maxReplicas": 4}).spec) == base
    assert renderer.spec_hash(_model(serving={"port": 8080, "kvCacheTokens": 8192}, dtype="auto").spec) == base
    assert renderer.spec_hash(_model(dtype="float16").spec) != base
    assert renderer.spec_hash(_model().spec, "other/image:1") != base
    assert renderer.spec_hash(_model(image=renderer.DEFAULT_IMAGE).spec) == base


def test_endpoint_is_the_serving_service_on_the_serving_port():
    assert renderer.endpoint(_model()) == "http://llama.prod.svc.cluster.local:8080"


def test_services_headless_publishes_unready_and_serving_selects_stage_zero():
    headless = renderer.render_headless_service(_model())
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    serving = renderer.render_serving_service(_model())
    assert serving["spec"]["selector"] == {"shardwise.dev/model": "llama", "shardwise.dev/stage": "0"}
    assert serving["spec"]["ports"][0]["port"] == 8080


def test_custom_gpu_resource_user_resources_and_tolerations_are_kept():
    model = _model(gpu={"resourceName": "amd.com/gpu"}, resources={"requests": {"cpu": "4", "memory": "16Gi"}},
                 placement={"tolerations": [{"key": "gpu", "operator": "Exists"}],
                            "nodeSelector": {"pool": "a100"}}, image="example/worker:1")
    plan = _plan(replicas=1, pipeline=1, tensor=8)
    pod = renderer.render_pod(model, plan, plan.placement(0, 0), attempt=0)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "4", "memory": "16Gi", "amd.com/gpu": "8"}
    assert "nvidia.com/gpu" not in res["limits"]
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["spec"]["nodeSelector"] == {"pool": "a100"}
    assert pod["spec"]["containers"][0]["image"] == "example/worker:1"


def test_replica_hash_changes_only_for_the_replanned_replica():
    plan = _plan()
    moved = plan.model_copy(deep=True)
    moved.placements[3].node = "elsewhere"  # replica 1, stage 1
    moved = ShardPlan.model_validate(moved.model_dump())
    assert renderer.replica_hash(plan, 0) == renderer.replica_hash(moved, 0)
    assert renderer.replica_hash(plan, 1) != renderer.replica_hash(moved, 1)
    assert renderer.plan_hash(plan) != renderer.plan_hash(moved)


def test_pdb_lets_a_drain_take_at_most_one_replica():
    assert renderer.render_pdb(_model(), replicas=3, pipeline=2)["spec"]["minAvailable"] == 4
    assert renderer.render_pdb(_model(), replicas=1, pipeline=2)["spec"]["minAvailable"] == 0
    assert "maxUnavailable" not in renderer.render_pdb(_model(), replicas=1, pipeline=2)["spec"]


def test_plain_path_uri_is_passed_through_without_a_volume():
    path, volume, mount = renderer.model_volume("/data/model.gguf")
    assert (path, volume, mount) == ("/data/model.gguf", None, None)


def _training_model(**spec):
    return _model(**{"workload": "training", "dtype": "float32",
                     "checkpoint": {"claim": "ckpt", "path": "/ckpt/run1", "intervalSteps": 25, "keep": 2},
                     "training": {"data": "pvc://corpora/text/wiki.txt", "steps": 300, "learningRate": 0.001,
                                  "batchSize": 16}, **spec})


def test_training_pods_form_one_world_over_all_replicas_and_get_the_job_settings():
    plan = _plan(replicas=2, pipeline=2, tensor=2)
    objects = _render(_training_model(), plan, {0: 3, 1: 3})
    pods = [o for o in objects if o["kind"] == "Pod"]
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    # every replica rendezvouses with replica 0's first stage, on the same port: one world (of the
    # plan's 8 ranks, which the worker counts from the plan)
    assert {e["MASTER_ADDR"] for e in envs} == {"llama-r0-s0.llama-ranks.prod.svc.cluster.local"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert "WORLD_SIZE" not in envs[0]
    contract = _contract(next(o for o in objects if o["kind"] == "ConfigMap"))
    assert contract.workload == "training" and contract.model.dtype == "float32"
    t, ck = contract.training, contract.checkpoint
    assert (t.steps, t.learning_rate, t.batch_size, t.micro_batches, t.seq_length) == (300, 0.001, 16, None, 64)
    assert (ck.path, ck.interval_steps, ck.keep) == ("/ckpt/run1", 25, 2)
    # the data claim is mounted read-only, the checkpoint claim writable at checkpoint.path
    assert t.data == "/data/corpora/text/wiki.txt"
    spec = pods[0]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "corpora", "readOnly": True}
    assert mounts["data"] == {"name": "data", "mountPath": "/data/corpora", "readOnly": True}
    assert volumes["checkpoint"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert mounts["checkpoint"]["mountPath"] == "/ckpt/run1" and not mounts["checkpoint"].get("readOnly")
    assert contract.termination_log == spec["containers"][0]["terminationMessagePath"]


def test_a_job_checkpointing_to_an_object_store_gets_its_credentials_apart_and_no_claim():
    """checkpoint.uri alone: no claim to mount, a small emptyDir for the progress report at `path`;
    the Secret's S3 keys under CHECKPOINT_ (a model fetched from another store keeps its own AWS_*);
    the contract names the store and no credential."""
    model = _training_model(checkpoint={"uri": "s3://ckpts/run1", "endpoint": "http://minio.storage:9000",
                                        "pathStyle": True, "credentialsRef": {"name": "ckpt-creds"}})
    plan = _plan()
    objects = _render(model, plan, {0: 0})
    spec = next(o for o in objects if o["kind"] == "Pod")["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert "persistentVolumeClaim" not in volumes["checkpoint"] and "emptyDir" in volumes["checkpoint"]
    assert mounts["checkpoint"]["mountPath"] == "/checkpoints"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["CHECKPOINT_AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "ckpt-creds", "key": "AWS_ACCESS_KEY_ID", "optional": True}
    assert {"CHECKPOINT_AWS_SECRET_ACCESS_KEY", "CHECKPOINT_AWS_SESSION_TOKEN"} <= set(env)
    assert "AWS_ACCESS_KEY_ID" not in env and not spec["containers"][0].get("envFrom")
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    ck = _contract(configmap).checkpoint
    assert (ck.uri, ck.endpoint, ck.path_style) == ("s3://ckpts/run1", "http://minio.storage:9000", True)
    assert "AWS_" not in json.dumps(configmap)


def test_a_training_job_has_no_serving_service_and_no_disruption_budget():
    kinds = sorted(o["kind"] for o in renderer.render_shared(_training_model(), _plan()))
    assert kinds == ["ConfigMap", "NetworkPolicy", "Service"]
    svc = next(o for o in renderer.render_shared(_training_model(), _plan()) if o["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None"   # the headless one, for the rendezvous


def test_inference_pods_keep_one_world_per_replica():
    plan = _plan(replicas=2, pipeline=2, tensor=2)
    pod = renderer.render_pod(_model(), plan, plan.placement(1, 0), attempt=0)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"].startswith("llama-r1-s0.")
    other = renderer.render_pod(_model(), plan, plan.placement(0, 0), attempt=0)
    assert {e["name"]: e.get("value") for e in other["spec"]["containers"][0]["env"]}["MASTER_ADDR"].startswith(
        "llama-r0-s0.")


def test_a_training_pod_gets_its_grace_period_and_the_local_tier_from_its_node():
    model = _training_model(checkpoint={"claim": "ckpt", "local": {"hostPath": "/mnt/nvme/ckpt/"}})
    plan = _plan()
    spec = renderer.render_pod(model, plan, plan.placement(0, 0), attempt=1)["spec"]
    assert spec["terminationGracePeriodSeconds"] == 120
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert volumes["local-checkpoint"]["hostPath"] == {"path": "/mnt/nvme/ckpt/prod/llama", "type": "DirectoryOrCreate"}
    assert mounts["local-checkpoint"]["mountPath"] == "/local-checkpoints"
    assert "local-checkpoint" not in {v["name"] for v in renderer.render_pod(
        _training_model(), plan, plan.placement(0, 0), attempt=1)["spec"]["volumes"]}
    served = renderer.render_pod(_model(), plan, plan.placement(0, 0), attempt=0)["spec"]
    assert served["terminationGracePeriodSeconds"] == renderer.SERVING_GRACE_SECONDS


def test_changing_min_replicas_changes_no_pod():
    a = _training_model(training={"data": "/d.txt", "steps": 5, "minReplicas": 1})
    b = _training_model(training={"data": "/d.txt", "steps": 5, "minReplicas": 2})
    c = _training_model(training={"data": "/d.txt", "steps": 5, "terminationGracePeriodSeconds": 60})
    assert renderer.spec_hash(a.spec) == renderer.spec_hash(b.spec) != renderer.spec_hash(c.spec)
