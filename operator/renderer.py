"""Renderer: a ShardedModel and its ShardPlan -> the Kubernetes objects that run it (pure, no I/O).

One Pod per (replica, pipeline stage), pinned to the planned node and asking for `tensor` GPUs; a
headless Service through which a replica's ranks find stage 0 (rendezvous); a serving Service in front
of every replica's stage 0; a ConfigMap with plan.json; a PodDisruptionBudget. Every object carries an
ownerReference to the ShardedModel, so deleting the model garbage-collects all of it.

Pod names carry the replica's attempt (`<model>-r<R>-s<S>-a<N>`) so that a recreated group never waits
for its torn-down predecessor to disappear; the DNS name the ranks rendezvous on is the pod's hostname
(`<model>-r<R>-s<S>`) under the headless Service, which stays the same across attempts.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from shardwise.crds.plan import ShardPlan, StagePlacement

API_VERSION = "shardwise.dev/v1alpha1"
KIND = "ShardedModel"

LABEL_MODEL = "shardwise.dev/model"
LABEL_REPLICA = "shardwise.dev/replica"
LABEL_STAGE = "shardwise.dev/stage"
LABEL_PLAN_HASH = "shardwise.dev/plan-hash"
LABEL_ATTEMPT = "shardwise.dev/attempt"
LABEL_SPEC_HASH = "shardwise.dev/spec-hash"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_PLANNED_NODE = "shardwise.dev/planned-node"   # where the plan put a pod not bound yet
MANAGED_BY = "shardwise"

PLAN_MOUNT = "/etc/shardwise"
PLAN_FILE = "plan.json"
MODEL_MOUNT = "/models"
DATA_MOUNT = "/data"
TERMINATION_LOG = "/dev/termination-log"
MASTER_PORT = 29500
DEFAULT_PORT = 8000
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_IMAGE = "ghcr.io/shardwise/worker:0.1.0-cuda"


def spec_get(spec: Mapping[str, Any] | None, path: str, default: Any = None) -> Any:
    """`spec_get(spec, "gpu.resourceName", "nvidia.com/gpu")`: a dotted lookup that tolerates absent parts."""
    node: Any = spec or {}
    for part in path.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return default
        node = node[part]
    return node


# --- names ---------------------------------------------------------------------------------------

def hostname(model: str, replica: int, stage: int) -> str:
    return f"{model}-r{replica}-s{stage}"


def pod_name(model: str, replica: int, stage: int, attempt: int) -> str:
    return f"{hostname(model, replica, stage)}-a{attempt}"


def headless_service_name(model: str) -> str:
    return f"{model}-ranks"


def serving_service_name(model: str) -> str:
    return model


def configmap_name(model: str) -> str:
    return f"{model}-plan"


def pdb_name(model: str) -> str:
    return model


def master_addr(model: str, namespace: str, replica: int) -> str:
    return f"{hostname(model, replica, 0)}.{headless_service_name(model)}.{namespace}.svc.cluster.local"


def master_port(namespace: str, model: str, replica: int, attempt: int) -> int:
    """The rendezvous port of one group incarnation, in 20000-29999.

    In a cluster every pod has its own network namespace and any fixed port would do. On the
    local-node runtime pods are processes sharing the machine's ports, and torch's TCPStore listens
    on all addresses: a port of its own per group and attempt keeps a predecessor that is still
    shutting down (or another group) from holding it."""
    digest = hashlib.sha256(f"{namespace}/{model}/{replica}/{attempt}".encode()).hexdigest()
    return 20000 + int(digest[:8], 16) % 10000


def is_training(spec: Mapping[str, Any] | None) -> bool:
    return spec_get(spec, "workload", "inference") == "training"


def endpoint(model: str, namespace: str, port: int) -> str:
    return f"http://{serving_service_name(model)}.{namespace}.svc.cluster.local:{port}"


# --- hashes --------------------------------------------------------------------------------------

def plan_json(plan: ShardPlan) -> str:
    return plan.model_dump_json(indent=2)


def plan_hash(plan: ShardPlan) -> str:
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:10]


def replica_hash(plan: ShardPlan, replica: int) -> str:
    """Hash of what one replica's pods depend on: the layout and that replica's placements only, so
    re-planning one replica leaves the others' labels (and pods) alone."""
    stages = [p.model_dump() for p in plan.stages_of(replica)]
    key = json.dumps({"tensor": plan.tensor, "pipeline": plan.pipeline, "layers": plan.num_layers,
                      "stages": stages}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def spec_hash(spec: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> str:
    """Hash of what a running pod depends on, besides its placement: a change rolls the replicas.
    Replicas, recovery and placement preferences are left out: changing them rolls nothing."""
    keep = {k: v for k, v in spec.items() if k not in ("parallelism", "recovery", "placement")}
    keep["parallelism"] = {k: v for k, v in (spec.get("parallelism") or {}).items() if k != "replicas"}
    keep["image"] = spec.get("image") or default_image
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:10]


# --- common metadata -----------------------------------------------------------------------------

def owner_reference(body: Mapping[str, Any]) -> dict:
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def model_labels(model: str) -> dict[str, str]:
    return {LABEL_MODEL: model, LABEL_MANAGED_BY: MANAGED_BY,
            "app.kubernetes.io/name": "shardwise-worker", "app.kubernetes.io/instance": model}


def _meta(body: Mapping[str, Any], name: str, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": body["metadata"]["namespace"], "labels": labels,
            "ownerReferences": [owner_reference(body)]}


# --- model location ------------------------------------------------------------------------------

def model_volume(uri: str, name: str = "model", root: str = MODEL_MOUNT) -> tuple[str, dict | None, dict | None]:
    """The path the worker reads from, and the volume + mount it needs (if any).

    `pvc://claim/sub/path` mounts the claim read-only at <root>/claim; any other uri is a path that
    already exists in the image or on the node and is passed through unchanged."""
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        mount = f"{root}/{claim}"
        volume = {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return (f"{mount}/{sub}" if sub else mount), volume, {"name": name, "mountPath": mount,
                                                               "readOnly": True}
    return uri, None, None


# spec.training field -> the variable the worker reads it from (worker/train.py TRAIN_ENV)
TRAINING_ENV = {
    "steps": "SHARDWISE_TRAIN_STEPS",
    "batchSize": "SHARDWISE_TRAIN_BATCH_SIZE",
    "seqLength": "SHARDWISE_TRAIN_SEQ_LEN",
    "learningRate": "SHARDWISE_TRAIN_LR",
    "warmupSteps": "SHARDWISE_TRAIN_WARMUP",
    "weightDecay": "SHARDWISE_TRAIN_WEIGHT_DECAY",
    "seed": "SHARDWISE_TRAIN_SEED",
    "microBatches": "SHARDWISE_TRAIN_MICRO_BATCHES",
}


def training_env(spec: Mapping[str, Any], data_path: str) -> list[dict]:
    """What a training pod's ranks train on and where they checkpoint (docs/training.md)."""
    training = spec_get(spec, "training", {}) or {}
    env = [{"name": "SHARDWISE_WORKLOAD", "value": "training"},
           {"name": "SHARDWISE_TRAIN_DATA", "value": data_path}]
    env += [{"name": var, "value": str(training[field])} for field, var in TRAINING_ENV.items()
            if training.get(field) is not None]
    env += [{"name": "SHARDWISE_CHECKPOINT_DIR", "value": spec_get(spec, "checkpoint.path", "/checkpoints")},
            {"name": "SHARDWISE_CHECKPOINT_EVERY", "value": str(spec_get(spec, "checkpoint.intervalSteps", 100))},
            {"name": "SHARDWISE_CHECKPOINT_KEEP", "value": str(spec_get(spec, "checkpoint.keep", 3))},
            # The job's result (steps done, last checkpoint) for the operator when the pod ends.
            {"name": "SHARDWISE_TERMINATION_LOG", "value": TERMINATION_LOG}]
    return env


# --- objects -------------------------------------------------------------------------------------

# Worker pods meet Pod Security "restricted": a non-root user (the worker image's uid 10001, or any
# non-root user of a custom image), no privilege escalation, no capabilities, the runtime's default
# seccomp profile. Ranks need none of these: gloo and NCCL use ordinary sockets and shared memory.
WORKER_POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
WORKER_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def render_pod(body: Mapping[str, Any], plan: ShardPlan, placement: StagePlacement, attempt: int,
               default_image: str = DEFAULT_IMAGE) -> dict:
    spec = body.get("spec", {})
    model = body["metadata"]["name"]
    namespace = body["metadata"]["namespace"]
    r, s = placement.replica, placement.stage
    port = int(spec_get(spec, "serving.port", DEFAULT_PORT))
    gpu_resource = spec_get(spec, "gpu.resourceName", DEFAULT_GPU_RESOURCE)
    model_path, volume, mount = model_volume(spec_get(spec, "model.uri", ""))

    labels = {**model_labels(model), LABEL_REPLICA: str(r), LABEL_STAGE: str(s),
              LABEL_PLAN_HASH: replica_hash(plan, r), LABEL_ATTEMPT: str(attempt),
              LABEL_SPEC_HASH: spec_hash(spec, default_image)}
    resources = _resources(spec, gpu_resource, placement.gpus)
    training = is_training(spec)
    # Inference: each replica is a world of its own. Training: one world over every replica (data
    # parallel averages gradients across them), rendezvousing at replica 0's first stage; the
    # replicas are created, torn down and re-planned together, so they share the attempt number.
    leader = 0 if training else r
    rendezvous = master_port(namespace, model, leader, attempt)
    world = plan.world_size * (plan.replicas if training else 1)
    env = [
        {"name": "SHARDWISE_MODEL_NAME", "value": model},
        {"name": "SHARDWISE_REPLICA", "value": str(r)},
        {"name": "SHARDWISE_STAGE", "value": str(s)},
        {"name": "MASTER_ADDR", "value": master_addr(model, namespace, leader)},
        {"name": "MASTER_PORT", "value": str(rendezvous)},
        {"name": "WORLD_SIZE", "value": str(world)},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    mounts = [{"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True}]
    volumes: list[dict] = [{"name": "plan", "configMap": {"name": configmap_name(model)}}]
    if volume:
        volumes.append(volume)
        mounts.append(mount)
    if training:
        data_path, data_volume, data_mount = model_volume(spec_get(spec, "training.data", ""), "data", DATA_MOUNT)
        env += training_env(spec, data_path)
        if data_volume:
            volumes.append(data_volume)
            mounts.append(data_mount)
    env += list(spec_get(spec, "env", []) or [])
    ckpt_claim = spec_get(spec, "checkpoint.claim")
    if ckpt_claim:
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": ckpt_claim}})
        mounts.append({"name": "checkpoint", "mountPath": spec_get(spec, "checkpoint.path", "/checkpoints")})

    container = {
        "name": "worker",
        "image": spec_get(spec, "image", None) or default_image,
        "command": ["shardwise", "worker"],
        "args": ["--plan", f"{PLAN_MOUNT}/{PLAN_FILE}", "--model", model_path, "--port", str(port)] + (
            ["--dtype", spec["dtype"]] if spec.get("dtype") not in (None, "auto") else []),
        "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  {"name": "rendezvous", "containerPort": rendezvous, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port},
                           "periodSeconds": 2, "failureThreshold": 3},
        "volumeMounts": mounts,
        # A failed pod's last log lines become its termination message, which the operator quotes
        # as the group's failure; a training pod that finished writes its result there instead.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": WORKER_CONTAINER_SECURITY,
    }
    pod_spec: dict[str, Any] = {
        # A torch.distributed group cannot lose a rank: the operator restarts the whole group instead.
        "restartPolicy": "Never",
        "hostname": hostname(model, r, s),
        "subdomain": headless_service_name(model),
        # Pinned by node *name* through required node affinity (what the DaemonSet controller does), so
        # the scheduler still checks GPU capacity and taints and reports why a pod does not fit.
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [placement.node]}]}]}}},
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 10,
        "enableServiceLinks": False,
        "securityContext": WORKER_POD_SECURITY,
    }
    selector = spec_get(spec, "placement.nodeSelector")
    if selector:
        pod_spec["nodeSelector"] = dict(selector)
    tolerations = spec_get(spec, "placement.tolerations")
    if tolerations:
        pod_spec["tolerations"] = list(tolerations)
    pull_secrets = spec_get(spec, "imagePullSecrets")
    if pull_secrets:
        pod_spec["imagePullSecrets"] = list(pull_secrets)
    meta = _meta(body, pod_name(model, r, s, attempt), labels)
    meta["annotations"] = {"shardwise.dev/layers": f"{placement.layer_start}-{placement.layer_end}",
                           ANNOTATION_PLANNED_NODE: placement.node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _resources(spec: Mapping[str, Any], gpu_resource: str, gpus: int) -> dict:
    user = spec_get(spec, "resources", {}) or {}
    requests = dict(user.get("requests") or {})
    limits = dict(user.get("limits") or {})
    # Extended resources must have request == limit; the TP degree is the GPU count of the pod.
    requests[gpu_resource] = str(gpus)
    limits[gpu_resource] = str(gpus)
    return {"requests": requests, "limits": limits}


def render_replica_pods(body: Mapping[str, Any], plan: ShardPlan, replica: int, attempt: int,
                        default_image: str = DEFAULT_IMAGE) -> list[dict]:
    """Every pod of one replica: the unit that is created, counted Ready and torn down together."""
    return [render_pod(body, plan, p, attempt, default_image) for p in plan.stages_of(replica)]


def render_headless_service(body: Mapping[str, Any]) -> dict:
    model = body["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(body, headless_service_name(model), model_labels(model)),
            "spec": {"clusterIP": "None", "selector": {LABEL_MODEL: model},
                     # Ranks rendezvous before any of them is Ready.
                     "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": "rendezvous"}]}}


def render_serving_service(body: Mapping[str, Any]) -> dict:
    model = body["metadata"]["name"]
    port = int(spec_get(body.get("spec"), "serving.port", DEFAULT_PORT))
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(body, serving_service_name(model), model_labels(model)),
            "spec": {"selector": {LABEL_MODEL: model, LABEL_STAGE: "0"},
                     "ports": [{"name": "http", "port": port, "targetPort": port}]}}


def render_configmap(body: Mapping[str, Any], plan: ShardPlan) -> dict:
    model = body["metadata"]["name"]
    meta = _meta(body, configmap_name(model), model_labels(model))
    meta["annotations"] = {"shardwise.dev/plan-hash": plan_hash(plan)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {PLAN_FILE: plan_json(plan)}}


def render_pdb(body: Mapping[str, Any], replicas: int, pipeline: int) -> dict:
    """A drain may take at most one replica's worth of pods: losing one pod stops its whole group, so
    with two or more replicas the others must keep serving. With one replica nothing can be protected
    without blocking drains forever (minAvailable 0; the group is recreated elsewhere).

    Always an integer minAvailable: with maxUnavailable or a percentage the disruption controller
    would ask the pods' controller (the ShardedModel) for its scale, which counts replicas, not pods."""
    model = body["metadata"]["name"]
    spec: dict[str, Any] = {"selector": {"matchLabels": {LABEL_MODEL: model}},
                            "minAvailable": max(0, replicas - 1) * pipeline}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(body, pdb_name(model), model_labels(model)), "spec": spec}


def render_shared(body: Mapping[str, Any], plan: ShardPlan) -> list[dict]:
    """The per-model objects (not per replica): services, plan ConfigMap, disruption budget.

    A training job has no API to serve, and no disruption budget: losing any of its pods stops
    the whole job (it resumes from the last checkpoint), and a budget that forbade that would
    block node drains for as long as the job runs."""
    if is_training(body.get("spec")):
        return [render_headless_service(body), render_configmap(body, plan)]
    return [render_headless_service(body), render_serving_service(body), render_configmap(body, plan),
            render_pdb(body, plan.replicas, plan.pipeline)]


def render_all(body: Mapping[str, Any], plan: ShardPlan, attempts: Mapping[int, int] | None = None,
               default_image: str = DEFAULT_IMAGE) -> list[dict]:
    attempts = attempts or {}
    objects = render_shared(body, plan)
    for r in sorted({p.replica for p in plan.placements}):
        objects += render_replica_pods(body, plan, r, attempts.get(r, 0), default_image)
    return objects
