"""Renderer: a ShardedModel and its ShardPlan -> the Kubernetes objects that run it (pure, no I/O).

One Pod per (replica, pipeline stage), pinned to the planned node and asking for `tensor` GPUs; a
headless Service through which a replica's ranks find stage 0 (rendezvous); a serving Service in front
of every replica's stage 0; a ConfigMap with the pod contract (crds/contract.py) as contract.json.gz; a
PodDisruptionBudget; a NetworkPolicy (render/netpolicy.py). Every object carries an ownerReference to
the ShardedModel, so deleting the model garbage-collects all of it. What the operator is configured
with (render/settings.py) is an argument, defaulting to the running operator's.

The spec is read typed (crds.models.ShardedModel): every default is the API's. The pod contract holds
everything the worker needs that is the same for every pod of the model (plan, model path, dtype,
workload, serving, training and checkpoint options); only the pod's identity and its rendezvous go in
its environment, since the ConfigMap is shared.

Pod names carry the replica's attempt (`<model>-r<R>-s<S>-a<N>`) so that a recreated group never waits
for its torn-down predecessor to disappear; the DNS name the ranks rendezvous on is the pod's hostname
(`<model>-r<R>-s<S>`) under the headless Service, which stays the same across attempts.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any, Mapping

from shardwise.crds import names
from shardwise.crds.capacity import DecodeMode, ServingCapacity
from shardwise.crds.contract import (SERVING_GRACE_SECONDS, ContractError, ModelContract, PodContract,
                                     ServingContract, contract_json)
from shardwise.crds.models import API_VERSION, KIND, Serving, ShardedModel, ShardedModelSpec, Workload, parse_pvc
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.operator.render import localtier, netpolicy, source
from shardwise.operator.render.settings import Settings, current

MODEL_MOUNT = "/models"
DATA_MOUNT = "/data"
TERMINATION_LOG = "/dev/termination-log"
MASTER_PORT = 29500
DEFAULT_PORT = Serving.model_fields["port"].default   # for pods that do not name their http port
DEFAULT_IMAGE = "ghcr.io/shardwise/worker:0.1.0-cuda"


# --- names ---------------------------------------------------------------------------------------

# One definition of each name, in crds/names.py (the API server's limit on a model's name is
# derived from them).
hostname = names.hostname
pod_name = names.pod_name
headless_service_name = names.headless_service_name
serving_service_name = names.serving_service_name
configmap_name = names.configmap_name
pdb_name = names.pdb_name
network_policy_name = names.network_policy_name


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


def endpoint(model: ShardedModel) -> str:
    """URL of the model's OpenAI-compatible API (its serving Service)."""
    return f"http://{serving_service_name(model.name)}.{model.namespace}.svc.cluster.local:{model.spec.serving.port}"


# --- hashes --------------------------------------------------------------------------------------

def plan_hash(plan: ShardPlan) -> str:
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:10]


def replica_hash(plan: ShardPlan, replica: int) -> str:
    """Hash of what one replica's pods depend on: the layout and that replica's placements only, so
    re-planning one replica leaves the others' labels (and pods) alone."""
    stages = [p.model_dump() for p in plan.stages_of(replica)]
    key = json.dumps({"tensor": plan.tensor, "pipeline": plan.pipeline, "layers": plan.num_layers,
                      "stages": stages}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def spec_hash(spec: ShardedModelSpec, default_image: str = DEFAULT_IMAGE) -> str:
    """Hash of what a running pod depends on, besides its placement: a change rolls the replicas.
    Replicas (training.minReplicas too), autoscaling (it only sets replicas), rollout (how a roll
    proceeds, not what it rolls to), recovery and placement preferences are left out: changing them rolls nothing. The
    typed spec has its defaults filled in, so writing a default out changes nothing either."""
    # serving.allowFrom is the NetworkPolicy's alone; serving.auth and the capacity settings, when
    # unset, are left out so that models made before they existed keep their hash (and their pods).
    # serving.router is the router's Deployment's alone (render/router.py): it never rolls the pods.
    serving_out = {"allow_from", "router"} | {f for f in ("auth", *CAPACITY_OPTIONAL) if getattr(spec.serving, f) is None}
    if spec.serving.decode == DecodeMode.AUTO:
        serving_out.add("decode")
    # spec.model's remote options, when unset, likewise (crds/sourcespec.py); fetchStreams always: it
    # is read when a pod starts, by the pods started after it changed, and re-fetching nothing is no
    # reason to restart the pods serving; prePull only says how the next group's pods start
    model_out = {f for f in REMOTE_OPTIONS if getattr(spec.model, f) is None} | {"fetch_streams", "pre_pull"}
    keep = spec.model_dump(mode="json", by_alias=True,
                           exclude={"recovery": True, "placement": True, "autoscaling": True, "rollout": True,
                                    "parallelism": {"replicas"},
                                    "training": {"min_replicas"}, "serving": serving_out, "model": model_out})
    keep["image"] = spec.image or default_image
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:10]


REMOTE_OPTIONS = ("endpoint", "region", "path_style", "credentials_ref", "cache")
# spec.serving's capacity settings that are None when omitted (crds/capacity.py)
CAPACITY_OPTIONAL = tuple(n for n, f in ServingCapacity.model_fields.items() if f.default is None)


# --- common metadata -----------------------------------------------------------------------------

def owner_reference(model: ShardedModel) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": model.name, "uid": model.metadata["uid"],
            "controller": True, "blockOwnerDeletion": True}


def model_labels(model: str) -> dict[str, str]:
    return {names.LABEL_MODEL: model, names.LABEL_MANAGED_BY: names.MANAGED_BY,
            names.LABEL_APP_NAME: "shardwise-worker", names.LABEL_APP_INSTANCE: model}


def _meta(model: ShardedModel, name: str, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": model.namespace, "labels": labels,
            "ownerReferences": [owner_reference(model)]}


# --- model location ------------------------------------------------------------------------------

def model_volume(uri: str, name: str = "model", root: str = MODEL_MOUNT) -> tuple[str, dict | None, dict | None]:
    """The path the worker reads from, and the volume + mount it needs (if any).

    `pvc://claim/sub/path` mounts the claim read-only at <root>/claim; any other uri is a path that
    already exists in the image or on the node and is passed through unchanged."""
    pvc = parse_pvc(uri)
    if pvc is not None:
        claim, sub = pvc
        mount = f"{root}/{claim}"
        volume = {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return (f"{mount}/{sub}" if sub else mount), volume, {"name": name, "mountPath": mount,
                                                               "readOnly": True}
    return uri, None, None


def _data_volume(model: ShardedModel) -> tuple[str, dict | None, dict | None]:
    return model_volume(model.spec.training.data, "data", DATA_MOUNT)


# --- the pod contract ----------------------------------------------------------------------------

def pod_contract(model: ShardedModel, plan: ShardPlan, settings: Settings | None = None) -> PodContract:
    """What every pod of the model is told (crds/contract.py), with paths as the pods see them."""
    spec = model.spec
    training = spec.training
    if training is not None:
        training = training.model_copy(update={"data": _data_volume(model)[0]})
    return PodContract(
        plan=plan,
        model=ModelContract(path=model_volume(spec.model.uri)[0], format=spec.model.format, dtype=spec.dtype),
        workload=spec.workload,
        serving=ServingContract(**spec.serving.model_dump(exclude={"auth", "allow_from", "router"}),
                                model_name=model.name),
        training=training, checkpoint=spec.checkpoint, termination_log=TERMINATION_LOG,
        source=source.contract(model, settings or current()))


def plan_from_configmap(configmap: Mapping[str, Any] | None) -> ShardPlan | None:
    """The plan the pods were last given, read back from the model's ConfigMap; None when there is
    none or it cannot be read (the caller plans afresh).

    Only the plan: the rest of the contract is the spec's, rendered again on every pass."""
    try:
        return PodContract.from_json(configmap_contract(configmap)).plan
    except ContractError:
        return None


def configmap_contract(configmap: Mapping[str, Any] | None) -> bytes:
    """The contract's JSON in the model's ConfigMap, as the pods read it (binaryData, base64 of gzip,
    inflated to at most CONTRACT_MAX_BYTES); ContractError (one line) when there is none or it cannot
    be read."""
    encoded = ((configmap or {}).get("binaryData") or {}).get(names.CONTRACT_FILE)
    if encoded is None:
        raise ContractError(f"the ConfigMap has no {names.CONTRACT_FILE}")
    where = f"the ConfigMap's {names.CONTRACT_FILE}"
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ContractError(f"{where} is not base64") from None
    return contract_json(data, where=where)


# --- pods ----------------------------------------------------------------------------------------

# Worker pods meet Pod Security "restricted": a non-root user (the worker image's uid 10001, or any
# non-root user of a custom image), no privilege escalation, no capabilities, the runtime's default
# seccomp profile. Ranks need none of these: gloo and NCCL use ordinary sockets and shared memory.
WORKER_POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
WORKER_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def render_pod(model: ShardedModel, plan: ShardPlan, placement: StagePlacement, attempt: int,
               default_image: str = DEFAULT_IMAGE, settings: Settings | None = None) -> dict:
    r, s = placement.replica, placement.stage
    labels = {**model_labels(model.name), names.LABEL_REPLICA: str(r), names.LABEL_STAGE: str(s),
              names.LABEL_PLAN_HASH: replica_hash(plan, r), names.LABEL_ATTEMPT: str(attempt),
              names.LABEL_SPEC_HASH: spec_hash(model.spec, default_image)}
    meta = _meta(model, pod_name(model.name, r, s, attempt), labels)
    meta["annotations"] = {names.ANNOTATION_LAYERS: f"{placement.layer_start}-{placement.layer_end}",
                           names.ANNOTATION_PLANNED_NODE: placement.node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": _pod_spec(model, placement, attempt, default_image, settings or current())}


def _rendezvous(model: ShardedModel, replica: int, attempt: int) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of a pod's torch.distributed world.

    Inference: each replica is a world of its own. Training: one world over every replica (data
    parallel averages gradients across them), rendezvousing at replica 0's first stage; the
    replicas are created, torn down and re-planned together, so they share the attempt number."""
    leader = 0 if model.spec.workload == Workload.TRAINING else replica
    return (master_addr(model.name, model.namespace, leader),
            master_port(model.namespace, model.name, leader, attempt))


def _env(placement: StagePlacement, addr: str, port: int) -> list[dict]:
    """The pod's identity and rendezvous: all that differs between pods sharing one contract."""
    return [
        {"name": names.ENV_REPLICA, "value": str(placement.replica)},
        {"name": names.ENV_STAGE, "value": str(placement.stage)},
        {"name": names.ENV_MASTER_ADDR, "value": addr},
        {"name": names.ENV_MASTER_PORT, "value": str(port)},
        {"name": names.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": names.ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]


def _volumes(model: ShardedModel) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): the contract, the model's claim, the data's claim (training), the
    checkpoint claim (or, with checkpoints in an object store only, a small emptyDir for the
    progress report)."""
    spec = model.spec
    volumes = [{"name": "plan", "configMap": {"name": configmap_name(model.name)}}]
    mounts = [{"name": "plan", "mountPath": names.CONTRACT_MOUNT, "readOnly": True}]
    claims = [model_volume(spec.model.uri)[1:]]
    if spec.training is not None:
        claims.append(_data_volume(model)[1:])
    for volume, mount in claims:
        if volume:
            volumes.append(volume)
            mounts.append(mount)
    if spec.checkpoint is not None and spec.checkpoint.claim:
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": spec.checkpoint.claim}})
        mounts.append({"name": "checkpoint", "mountPath": spec.checkpoint.path})
    elif spec.checkpoint is not None and spec.checkpoint.uri:
        # checkpoints in an object store and no claim: `path` holds only the job's progress report
        volumes.append({"name": "checkpoint", "emptyDir": {"sizeLimit": "16Mi"}})
        mounts.append({"name": "checkpoint", "mountPath": spec.checkpoint.path})
    if spec.checkpoint is not None and spec.checkpoint.local is not None:
        volumes.append({"name": "local-checkpoint", "hostPath": {
            "path": local_checkpoint_dir(model), "type": "DirectoryOrCreate"}})
        mounts.append({"name": "local-checkpoint", "mountPath": spec.checkpoint.local.path})
    if _api_keys(model):
        ref = spec.serving.auth.secret_ref
        volumes.append({"name": "api-keys", "secret": {"secretName": ref.name, "defaultMode": 0o444,
                                                       "items": [{"key": ref.key, "path": "keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": names.API_KEYS_MOUNT, "readOnly": True})
    return volumes, mounts


def _api_keys(model: ShardedModel) -> bool:
    """Whether the pods check API keys: a served model with spec.serving.auth (a training job serves
    no API)."""
    return model.spec.serving.auth is not None and model.spec.workload == Workload.INFERENCE


def local_checkpoint_dir(model: ShardedModel) -> str:
    """The node directory of a model's local checkpoint tier: <hostPath>/<namespace>/<model name>.
    A hostPath, not an emptyDir: a restarted job's pods are new pods, and an emptyDir dies with its
    pod; the node's directory outlives them (and dies with the node, which the shared tier covers)."""
    return localtier.directory(model.spec.checkpoint.local.host_path, model.namespace, model.name)


LOCAL_TIER_MOUNT = "/local-tier"   # where the preparing init container sees the tier's directory


def _prepare_local_tier(default_image: str) -> dict:
    """The init container that hands the local tier's directory to the worker's group: the kubelet
    makes it root-owned 0755, and fsGroup does not apply to a hostPath. It runs the operator's own
    worker image (never spec.image) as root with no capability at all: root owns the directory,
    so it may chmod it and give it to a group it is in (its own); setgid keeps new files in it."""
    gid = names.WORKER_GID
    return {"name": "prepare-local-tier", "image": default_image,
            "command": ["sh", "-c", f"chgrp {gid} {LOCAL_TIER_MOUNT} && chmod 2770 {LOCAL_TIER_MOUNT}"],
            "volumeMounts": [{"name": "local-checkpoint", "mountPath": LOCAL_TIER_MOUNT}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": {"runAsUser": 0, "runAsGroup": gid, "runAsNonRoot": False,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}


def grace_seconds(spec: ShardedModelSpec) -> int:
    """terminationGracePeriodSeconds: a training rank saves a shared checkpoint on SIGTERM; a
    serving pod drains its requests (crds/contract.py DRAIN_SECONDS)."""
    return spec.training.termination_grace_period_seconds if spec.training is not None else SERVING_GRACE_SECONDS


def _resources(spec: ShardedModelSpec, gpus: int) -> dict:
    requests = dict(spec.resources.requests) if spec.resources else {}
    limits = dict(spec.resources.limits) if spec.resources else {}
    # Extended resources must have request == limit; the TP degree is the GPU count of the pod.
    requests[spec.gpu.resource_name] = str(gpus)
    limits[spec.gpu.resource_name] = str(gpus)
    return {"requests": requests, "limits": limits}


def _container(model: ShardedModel, placement: StagePlacement, attempt: int, default_image: str,
               mounts: list[dict]) -> dict:
    port = model.spec.serving.port
    addr, rendezvous = _rendezvous(model, placement.replica, attempt)
    return {
        "name": "worker",
        "image": model.spec.image or default_image,
        "command": ["shardwise", "worker"],
        "args": ["--contract", names.CONTRACT_PATH] + (["--api-key-file", names.API_KEYS_PATH]
                                                       if _api_keys(model) else []),
        "env": _env(placement, addr, rendezvous),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  {"name": "rendezvous", "containerPort": rendezvous, "protocol": "TCP"}],
        "resources": _resources(model.spec, placement.gpus),
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port},
                           "periodSeconds": 2, "failureThreshold": 3},
        "volumeMounts": mounts,
        # A failed pod's last log lines become its termination message, which the operator quotes
        # as the group's failure; a training pod that finished writes its result there instead
        # (the contract's termination_log is this same path).
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": WORKER_CONTAINER_SECURITY,
    }


def _pod_spec(model: ShardedModel, placement: StagePlacement, attempt: int, default_image: str,
              settings: Settings) -> dict:
    volumes, mounts = _volumes(model)
    pod_spec: dict[str, Any] = {
        # A torch.distributed group cannot lose a rank: the operator restarts the whole group instead.
        "restartPolicy": "Never",
        "hostname": hostname(model.name, placement.replica, placement.stage),
        "subdomain": headless_service_name(model.name),
        # Pinned by node *name* through required node affinity (what the DaemonSet controller does), so
        # the scheduler still checks GPU capacity and taints and reports why a pod does not fit.
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [placement.node]}]}]}}},
        "containers": [_container(model, placement, attempt, default_image, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace_seconds(model.spec),
        "enableServiceLinks": False,
        "securityContext": WORKER_POD_SECURITY,
    }
    checkpoint = model.spec.checkpoint
    if checkpoint is not None and checkpoint.local is not None:
        # The tier's directory belongs to the worker's group (the init container, or whoever prepared
        # the node): every container is in it, whatever its uid. A supplemental group, not fsGroup:
        # fsGroup does not apply to a hostPath, and would chown the checkpoint claim instead.
        pod_spec["securityContext"] = {**WORKER_POD_SECURITY, "supplementalGroups": [names.WORKER_GID]}
        if settings.prepare_local_checkpoints:
            pod_spec["initContainers"] = [_prepare_local_tier(default_image)]
    source.apply(pod_spec, model, settings, default_image)   # a remote model's credentials and cache
    placement_spec = model.spec.placement
    if placement_spec.node_selector:
        pod_spec["nodeSelector"] = dict(placement_spec.node_selector)
    if placement_spec.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in placement_spec.tolerations]
    return pod_spec


def render_replica_pods(model: ShardedModel, plan: ShardPlan, replica: int, attempt: int,
                        default_image: str = DEFAULT_IMAGE, settings: Settings | None = None) -> list[dict]:
    """Every pod of one replica: the unit that is created, counted Ready and torn down together."""
    return [render_pod(model, plan, p, attempt, default_image, settings) for p in plan.stages_of(replica)]


# --- shared objects ------------------------------------------------------------------------------

def render_headless_service(model: ShardedModel) -> dict:
    name = model.name
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(model, headless_service_name(name), model_labels(name)),
            "spec": {"clusterIP": "None", "selector": {names.LABEL_MODEL: name},
                     # Ranks rendezvous before any of them is Ready.
                     "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": "rendezvous"}]}}


def render_serving_service(model: ShardedModel) -> dict:
    """In front of every replica's stage 0, or of the router's pods when spec.serving.router is
    enabled (they listen on the same port)."""
    name, port = model.name, model.spec.serving.port
    selector = ({names.LABEL_ROUTER: name} if router_enabled(model)
                else {names.LABEL_MODEL: name, names.LABEL_STAGE: "0"})
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(model, serving_service_name(name), model_labels(name)),
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": port, "targetPort": port}]}}


def router_enabled(model: ShardedModel | ShardedModelSpec) -> bool:
    """Whether the model runs its router (render/router.py): a serving model that asks for it."""
    spec = model.spec if isinstance(model, ShardedModel) else model
    router = spec.serving.router
    return router is not None and router.enabled and spec.workload != Workload.TRAINING


def render_configmap(model: ShardedModel, plan: ShardPlan, settings: Settings | None = None) -> dict:
    """The pod contract every pod of the model mounts at /etc/shardwise/contract.json.gz: gzip in
    binaryData, since a ConfigMap holds 1 MiB at most and the plan lists every placement (10,000
    replicas of 4 stages: about 5.8 MB of JSON, 0.2 MB gzipped)."""
    meta = _meta(model, configmap_name(model.name), model_labels(model.name))
    meta["annotations"] = {names.ANNOTATION_PLAN_HASH: plan_hash(plan)}
    contract = base64.b64encode(pod_contract(model, plan, settings).to_gzip()).decode("ascii")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "binaryData": {names.CONTRACT_FILE: contract}}


def render_pdb(model: ShardedModel, replicas: int, pipeline: int) -> dict:
    """A drain may take at most one replica's worth of pods: losing one pod stops its whole group, so
    with two or more replicas the others must keep serving. With one replica nothing can be protected
    without blocking drains forever (minAvailable 0; the group is recreated elsewhere).

    Always an integer minAvailable: with maxUnavailable or a percentage the disruption controller
    would ask the pods' controller (the ShardedModel) for its scale, which counts replicas, not pods."""
    spec: dict[str, Any] = {"selector": {"matchLabels": {names.LABEL_MODEL: model.name}},
                            "minAvailable": max(0, replicas - 1) * pipeline}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(model, pdb_name(model.name), model_labels(model.name)), "spec": spec}


def render_network_policy(model: ShardedModel, settings: Settings | None = None) -> dict:
    meta = _meta(model, network_policy_name(model.name), model_labels(model.name))
    return netpolicy.render(model, meta, settings or current())


def render_shared(model: ShardedModel, plan: ShardPlan, settings: Settings | None = None) -> list[dict]:
    """The per-model objects (not per replica): services, the contract's ConfigMap, disruption budget,
    and the NetworkPolicy unless the operator is told not to make one.

    A training job has no API to serve, and no disruption budget: losing any of its pods stops
    the whole job (it resumes from the last checkpoint), and a budget that forbade that would
    block node drains for as long as the job runs."""
    settings = settings or current()
    # the policy first: no pod of the model runs before it exists
    policy = [render_network_policy(model, settings)] if settings.network_policy else []
    if model.spec.workload == Workload.TRAINING:
        return policy + [render_headless_service(model), render_configmap(model, plan, settings)]
    return policy + [render_headless_service(model), render_serving_service(model),
                     render_configmap(model, plan, settings),
                     render_pdb(model, plan.replicas, plan.pipeline)]
