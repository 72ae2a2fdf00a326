"""The ShardedModel API: spec and status as pydantic models.

These models are the one definition of the API. The CRD YAML (`shardedmodels.shardwise.dev.yaml`)
is generated from them by `shardwise crds generate`; `shardwise crds check` fails when the two drift.
Python attributes are snake_case; the JSON a user writes is camelCase (`parallelism.tensor`,
`model.uri`, `recovery.maxRestarts`), as Kubernetes users expect.

Rules that cross fields are CEL rules (`x-kubernetes-validations`) attached with `_cel(...)`, so the
API server refuses a bad manifest before the operator sees it. The same rules are checked in Python
by validators where that is cheap, so `shardwise plan -f` refuses the same manifests offline.

The spec is here; the status is in crds/status.py, the base model and the helpers fields share in
crds/apimodel.py, the pipeline-schedule rules in crds/schedules.py, spec.training in
crds/training.py. Every name of those an importer of the API needs is importable from here too.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from shardwise.crds.apimodel import (LABEL_KEY_PATTERN, QUANTITY_PATTERN, ApiModel, cel, describe_validation_error,
                                     malformed_pvc, parse_pvc, parse_quantity, pvc_rule)
from shardwise.crds.autoscaling import Autoscaling
from shardwise.crds.router import ROUTER_RULE, Router, check_workload as router_check
from shardwise.crds.rollout import Rollout
from shardwise.crds.capacity import DecodeMode, ServingCapacity
from shardwise.crds.access import (DNS_SUBDOMAIN_PATTERN, LABEL_VALUE_PATTERN, PEER_NEEDS_SELECTOR,  # noqa: F401
                                   LabelSelector, NetworkPeer, SecretKeyRef, ServingAuth)
from shardwise.crds.names import (LOCAL_CHECKPOINT_ROOT, MAX_MODEL_NAME, MAX_PIPELINE,
                                  MAX_REPLICAS, MODEL_NAME_PATTERN, RACK_LABEL, ZONE_LABEL)
from shardwise.crds.speculative import (DRAFT_TOKENS, DRAFT_TOKENS_MAX, NGRAM_LIMIT, NGRAM_MAX,  # noqa: F401
                                      NGRAM_MIN, Speculative, SpeculativeMethod)
from shardwise.crds import sourcespec
from shardwise.crds.sourcespec import ENDPOINT_PATTERN, REGION_PATTERN, CredentialsRef, ModelCache
from shardwise.crds.schedules import INTERLEAVED_MICRO_BATCHES, PipelineSchedule
from shardwise.crds.training import (CP_DIVIDES, CP_SEQUENCE, DP_DIVIDES, DP_PRODUCT, MIN_REPLICAS, TRAINING_DATA_PVC,  # noqa: F401
                                     TRAINING_LAYOUT_RULES, DataParallel, GradientCompression, Training,
                                     check_layout as check_training_layout)
from shardwise.crds.checkpointstore import STORE_OPTIONS_NEED_URI, ObjectStoreCheckpoint, store_rule
from shardwise.crds.status import (PHASES, Condition, GroupPhase, LastCheckpoint, ModelFactsStatus, ModelPhase,
                                   PlacementSummary, PlanSummary, ReplicaGroupStatus, ShardedModelStatus,
                                   TrainingProgress)

__all__ = [  # re-exported: the API's names, importable from one module
    "LABEL_KEY_PATTERN", "QUANTITY_PATTERN", "ApiModel", "describe_validation_error", "parse_pvc", "parse_quantity",
    "INTERLEAVED_MICRO_BATCHES", "PipelineSchedule", "PHASES", "Condition", "GroupPhase", "LastCheckpoint",
    "ModelFactsStatus", "ModelPhase", "PlacementSummary", "PlanSummary", "ReplicaGroupStatus",
    "ShardedModelStatus", "TrainingProgress", "DecodeMode", "DataParallel", "GradientCompression", "Training"]

GROUP = "shardwise.dev"
VERSION = "v1alpha1"
KIND = "ShardedModel"
PLURAL = "shardedmodels"
SINGULAR = "shardedmodel"
SHORT_NAMES = ["sm"]
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_TOPOLOGY_KEYS = [RACK_LABEL, ZONE_LABEL]


class Workload(str, Enum):
    """What a ShardedModel runs (operator/decide/workloads.py says what differs between them)."""

    INFERENCE = "inference"    # serves the OpenAI-compatible API
    TRAINING = "training"      # trains and writes sharded checkpoints

# ---------------------------------------------------------------- spec


# The largest model shape the operator accepts, from hints (the schema's maxima) or from a probe
# (operator/decide/probe.py): far above any model there is, low enough that the planner's work and
# its arithmetic stay bounded. Keys are ModelFacts' fields.
MODEL_FACT_LIMITS = {"layers": 4096, "heads": 4096, "kv_heads": 4096, "hidden": 2**20, "intermediate": 2**22,
                     "vocab": 2**24, "params": 10**15, "experts": 4096, "shared_intermediate": 2**22}

MODEL_URI_PVC = "model.uri must look like pvc://<claim>/<path> when it starts with pvc://"


class ModelSource(sourcespec.FetchSettings):
    """Where the weights are and, when the operator cannot read them, what the model looks like."""

    model_config = ConfigDict(json_schema_extra=cel(
        ("self.format != 'gguf' || self.uri.endsWith('.gguf')",
         "model.uri must name a .gguf file when model.format is gguf", ".uri"),
        pvc_rule("uri", MODEL_URI_PVC),
        ("!has(self.heads) || !has(self.kvHeads) || self.heads % self.kvHeads == 0",
         "model.heads must be a multiple of model.kvHeads", ".kvHeads"),
        *sourcespec.cel_rules(),
    ))

    uri: str = Field(min_length=1, max_length=4096, description=(
        "The weights: a path inside the pod (an HF-format directory with config.json and "
        "*.safetensors, or a .gguf file), pvc://<claim>/<path> to mount a PersistentVolumeClaim, or "
        "where the model lives, fetched by the pods into a node-local cache: hf://<org>/<name>[@<revision>]"
        "[/<file>.gguf], s3://<bucket>/<prefix>, oci://<registry>/<repository>:<tag>."))
    format: Literal["auto", "safetensors", "gguf"] = Field(
        "auto", description="auto: gguf when the uri ends in .gguf, safetensors otherwise.")
    parameters: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["params"], description=(
        "Parameter count. A hint for the planner when the operator cannot read the model's files."))
    layers: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["layers"], description="Decoder layers (hint).")
    heads: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["heads"], description="Attention heads (hint).")
    kv_heads: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["kv_heads"], description="Key/value heads, for GQA (hint).")
    hidden_size: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["hidden"], description="Hidden size (hint).")
    intermediate_size: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["intermediate"],
                                             description="MLP intermediate size (hint).")
    vocab_size: Optional[int] = Field(None, ge=1, le=MODEL_FACT_LIMITS["vocab"], description="Vocabulary size (hint).")
    # A remote source's options (crds/sourcespec.py); all unset by default, so that a model made
    # before they existed keeps its spec hash (and its pods).
    endpoint: Optional[str] = Field(None, max_length=2048, pattern=ENDPOINT_PATTERN, description=(
        "s3:// only: the S3-compatible endpoint, http(s)://host[:port][/path] (no credentials in it). "
        "Omitted: AWS S3."))
    region: Optional[str] = Field(None, max_length=64, pattern=REGION_PATTERN,
                                  description="s3:// only: the bucket's region.")
    path_style: Optional[bool] = Field(None, description=(
        "s3:// only: address the bucket as <endpoint>/<bucket> rather than <bucket>.<endpoint> "
        "(MinIO and most S3-compatible stores)."))
    credentials_ref: Optional[CredentialsRef] = Field(None, description=(
        "hf://, s3://, oci://: the Secret whose keys the pods fetch with (see its name field)."))
    cache: Optional[ModelCache] = Field(None, description=(
        "hf://, s3://, oci://: where the pods keep the fetched files. node (default): the node-local "
        "cache the operator is configured with, shared by the namespace's pods on the node (a "
        "hostPath: refused where Pod Security enforces baseline or restricted); pod: an emptyDir of "
        "each pod, fetched again by every pod."))

    @model_validator(mode="after")
    def _cross_checks(self) -> "ModelSource":
        if self.format == "gguf" and not self.uri.endswith(".gguf"):
            raise ValueError("model.uri must name a .gguf file when model.format is gguf")
        source_problem = sourcespec.source_problem(self)
        if source_problem:
            raise ValueError(source_problem)
        if malformed_pvc(self.uri):
            raise ValueError(MODEL_URI_PVC)
        if self.heads and self.kv_heads and self.heads % self.kv_heads:
            raise ValueError("model.heads must be a multiple of model.kvHeads")
        return self

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        return "gguf" if self.uri.endswith(".gguf") else "safetensors"

    def remote_scheme(self) -> str:
        """hf, s3 or oci for a model the pods fetch; "" for a path or pvc://."""
        return sourcespec.scheme(self.uri) if sourcespec.is_remote(self.uri) else ""

    def pvc(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for a pvc:// uri, None otherwise."""
        return parse_pvc(self.uri)


class Parallelism(ApiModel):
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.expert) || !has(self.tensor) || self.expert == self.tensor",
         "parallelism.expert must equal parallelism.tensor (the experts are split across the tensor group)",
         ".expert"),
    ))

    tensor: Optional[int] = Field(None, ge=1, le=64, description=(
        "Tensor-parallel degree: GPUs per pipeline stage, always on one node. Omitted: the planner "
        "chooses the smallest degree that fits. Must divide the model's attention and KV heads (and "
        "a mixture of experts' experts)."))
    expert: Optional[int] = Field(None, ge=1, le=64, description=(
        "Expert-parallel degree of a mixture-of-experts model: its experts split across the ranks of "
        "the tensor group, inside one node (EP = TP). Given alone it sets the tensor degree; given "
        "with tensor it must equal it. Omitted: the planner chooses, as for tensor. Must divide the "
        "experts."))
    pipeline: Optional[int] = Field(None, ge=1, le=MAX_PIPELINE, description="Pipeline stages per replica, one pod each. Omitted: the planner chooses.")
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description=(
        "Independent copies of the model (data parallel). Behind the scale subresource, so "
        "`kubectl scale sm/NAME --replicas=N` and HPA work."))

    @model_validator(mode="after")
    def _expert_is_the_tensor_group(self) -> "Parallelism":
        if self.expert is not None:
            if self.tensor is not None and self.tensor != self.expert:
                raise ValueError(f"parallelism.expert {self.expert} must equal parallelism.tensor {self.tensor} "
                                 f"(the experts are split across the tensor group)")
            self.tensor = self.expert
        return self


class GPU(ApiModel):
    resource_name: str = Field(DEFAULT_GPU_RESOURCE, min_length=1, max_length=253, description="Extended resource the pods request.")
    product: Optional[str] = Field(None, max_length=253, description=(
        "Only nodes whose nvidia.com/gpu.product label equals this."))
    min_memory: Optional[str] = Field(None, pattern=QUANTITY_PATTERN, max_length=32, description=(
        "Only GPUs with at least this much memory (nvidia.com/gpu.memory label), e.g. 40Gi. Also the "
        "memory assumed for nodes without that label."))

    def min_memory_bytes(self) -> int:
        return parse_quantity(self.min_memory) if self.min_memory else 0


class Toleration(ApiModel):
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.operator != 'Exists' || !has(self.value) || self.value == ''",
         "a toleration with operator Exists must not set value", ".value"),
        ("self.operator != 'Equal' || has(self.key)",
         "a toleration with operator Equal needs a key", ".key"),
    ))

    key: Optional[str] = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: Optional[str] = Field(None, max_length=63)
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = None

    @model_validator(mode="after")
    def _cross_checks(self) -> "Toleration":
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists must not set value")
        if self.operator == "Equal" and not self.key:
            raise ValueError("a toleration with operator Equal needs a key")
        return self


class Placement(ApiModel):
    topology_keys: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOPOLOGY_KEYS), max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": list(DEFAULT_TOPOLOGY_KEYS),
                           "items": {"type": "string", "maxLength": 316, "pattern": LABEL_KEY_PATTERN}},
        description=("Node label keys naming topology domains, tightest first (a node is always the "
                     "tightest: its GPUs share NVLink). A replica's stages go to the tightest domain "
                     "that holds them; replicas spread across domains."))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Only nodes with these labels.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description=(
        "Taints the pods tolerate; nodes with other NoSchedule/NoExecute taints are not used."))

    @field_validator("topology_keys")
    @classmethod
    def _keys_are_unique_label_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if len(key) > 316 or not re.match(LABEL_KEY_PATTERN, key):
                raise ValueError(f"{key!r} is not a node label key")
        if len(set(keys)) != len(keys):
            raise ValueError("topology keys must not repeat")
        return keys


# spec.checkpoint: the local tier needs the shared one, and a mount path of its own.
LOCAL_NEEDS_CLAIM = ("checkpoint.local needs checkpoint.claim or checkpoint.uri: the shared tier a job resumes "
                     "from when a node and its local tier are gone")
LOCAL_PATH_DIFFERS = "checkpoint.local.path must differ from checkpoint.path"
TRAINING_NEEDS_SHARED_TIER = ("workload training needs checkpoint.claim or checkpoint.uri: a ReadWriteMany claim "
                              "or an object store every pod writes its shards to")


class LocalCheckpoint(ApiModel):
    """The local tier: frequent checkpoints on each node's own disk, fast to write and read back; lost
    with the node, so the shared tier (checkpoint.claim) stays what a job falls back to."""

    path: str = Field("/local-checkpoints", max_length=4096, pattern=r"^/", description=(
        "Directory of the local checkpoints inside the pod; must differ from checkpoint.path."))
    host_path: str = Field(LOCAL_CHECKPOINT_ROOT, max_length=4096, pattern=r"^/", description=(
        "Directory on the node, one of the roots the operator allows (`operator run "
        "--local-checkpoint-root`; a model naming another is refused in its status); each pod mounts "
        "<hostPath>/<namespace>/<model name> of its node (hostPath type DirectoryOrCreate), which "
        "outlives the pod: a restarted job's new pods on the same node read it back."))
    interval_steps: int = Field(10, ge=1, description="Training steps between local checkpoints.")
    keep: int = Field(2, ge=1, le=1000, description="Local checkpoints kept per node; older ones are deleted.")


class Checkpoint(ObjectStoreCheckpoint):
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.local) || has(self.claim) || has(self.uri)", LOCAL_NEEDS_CLAIM, ".local"),
        store_rule(),
        ("!has(self.local) || self.local.path != self.path", LOCAL_PATH_DIFFERS, ".local.path"),
    ))

    claim: Optional[str] = Field(None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                 description="PersistentVolumeClaim mounted at `path` in every pod.")
    path: str = Field("/checkpoints", max_length=4096, pattern=r"^/",
                      description="Directory of the sharded checkpoints inside the pod.")
    interval_steps: int = Field(100, ge=1, description="Training steps between checkpoints.")
    keep: int = Field(3, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")
    local: Optional[LocalCheckpoint] = Field(None, description=(
        "A second, node-local tier written more often than the shared one (training); needs claim or uri."))

    @model_validator(mode="after")
    def _cross_checks(self) -> "Checkpoint":
        if self.local is not None and not self.claim and not self.uri:
            raise ValueError(LOCAL_NEEDS_CLAIM)
        if self.store_options_without_uri():
            raise ValueError(STORE_OPTIONS_NEED_URI)
        if self.local is not None and self.local.path == self.path:
            raise ValueError(f"{LOCAL_PATH_DIFFERS} (both {self.path})")
        return self


class Recovery(ApiModel):
    max_restarts: int = Field(3, ge=0, le=1000, description=(
        "Restarts of one replica group before that group gives up (Failed). The model is Degraded "
        "while other replicas serve, and Failed when every group gave up."))
    backoff_seconds: int = Field(10, ge=0, le=3600, description="Wait before recreating a failed group.")
    allow_shrink: bool = Field(False, description=(
        "When capacity is short, run fewer replicas (or another layout when tensor/pipeline are "
        "omitted) instead of waiting."))


class Quantization(str, Enum):
    """How a serving worker holds its weights (crds/modelshape.py ModelFacts.quantized sizes it)."""

    NONE = "none"      # in spec.dtype
    INT8 = "int8"      # weight-only INT8: the decoder layers' matrices, one scale per output row
    GGUF = "gguf"      # a GGUF file's Q8_0, Q4_0 and Q4_1 blocks kept as stored (worker/weights/gguf_blocks.py)
    AUTO = "auto"      # gguf (a Q8_0/Q4_0/Q4_1 GGUF), then int8, only when the GPUs cannot hold the model otherwise


# What a replica takes on at once (kvCacheTokens, maxConcurrentRequests, ...) is the base's, crds/capacity.py.
class Serving(ServingCapacity):
    """How the model serves: its API's port and capacity, how the weights are held, who may call it."""

    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible HTTP API.")
    quantization: Quantization = Field(Quantization.NONE, description=(
        "none: weights in spec.dtype; int8: the decoder layers' weight matrices in INT8 (one scale "
        "per output row), half of bf16's memory; gguf: a GGUF model's Q8_0, Q4_0 or Q4_1 blocks "
        "kept as stored, 0.625 bytes a parameter for Q4_0/Q4_1 and 1.25 for Q8_0 (other models are "
        "refused); auto: only when the GPUs available cannot hold the model otherwise, gguf (when "
        "the model is such a GGUF) before int8 (the plan's notes say so)."))
    offload: bool = Field(False, description=(
        "When the GPUs available cannot hold the model's weights, keep the decoder layers that do not "
        "fit in host memory and stream each to its GPU ahead of its turn (slower: every step copies them "
        "over PCIe). The planner uses it only when no plan holds every replica otherwise."))
    auth: Optional[ServingAuth] = Field(None, description=(
        "API keys: omitted, the API is open to whoever reaches the port."))
    allow_from: list[NetworkPeer] = Field(default_factory=list, max_length=16, description=(
        "Who may reach the serving port through the model's NetworkPolicy (the operator's pods "
        "always may). Empty: anyone."))
    speculative: Speculative = Field(default_factory=Speculative, json_schema_extra={"default": {}}, description=(
        "Speculative decoding (prompt lookup): several tokens a step for greedy requests whose text "
        "repeats its prompt or itself (code edits, summaries, quotes)."))
    router: Optional[Router] = Field(None, description="The model's router in front of its replicas (docs/operator.md, The router).")


class Resources(ApiModel):
    """CPU and memory for each pod. The GPU count comes from the plan, not from here."""

    requests: dict[str, str] = Field(default_factory=dict, json_schema_extra={
        "additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN}})
    limits: dict[str, str] = Field(default_factory=dict, json_schema_extra={
        "additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN}})

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _quantities_as_strings(cls, value: Any) -> Any:
        return {k: str(v) for k, v in value.items()} if isinstance(value, dict) else value


AUTOSCALING_SERVING_ONLY = "spec.autoscaling is only for workload: inference"


class ShardedModelSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.parallelism.tensor) || !has(self.model.heads) || self.model.heads % self.parallelism.tensor == 0",
         "parallelism.tensor must divide model.heads", ".parallelism.tensor"),
        ("!has(self.parallelism.tensor) || !has(self.model.kvHeads) || self.model.kvHeads % self.parallelism.tensor == 0",
         "parallelism.tensor must divide model.kvHeads", ".parallelism.tensor"),
        ("!has(self.parallelism.pipeline) || !has(self.model.layers) || self.parallelism.pipeline <= self.model.layers",
         "parallelism.pipeline must not exceed model.layers", ".parallelism.pipeline"),
        ("!has(self.resources) || !has(self.resources.limits) || !(self.gpu.resourceName in self.resources.limits)",
         "resources.limits must not name the GPU resource; the plan sets the GPU count", ".resources.limits"),
        ("!has(self.resources) || !has(self.resources.requests) || !(self.gpu.resourceName in self.resources.requests)",
         "resources.requests must not name the GPU resource; the plan sets the GPU count", ".resources.requests"),
        ("!has(oldSelf.workload) || self.workload == oldSelf.workload",
         "workload cannot change; create a new ShardedModel", ".workload"),
        ("self.workload != 'training' || has(self.training)",
         "workload training needs spec.training (at least data and steps)", ".training"),
        ("self.workload != 'training' || (has(self.checkpoint) && (has(self.checkpoint.claim) || "
         "has(self.checkpoint.uri)))", TRAINING_NEEDS_SHARED_TIER, ".checkpoint"),
        ("!has(self.training) || self.workload == 'training'",
         "spec.training is only for workload: training", ".training"),
        ("!has(self.autoscaling) || self.workload != 'training'", AUTOSCALING_SERVING_ONLY, ".autoscaling"),
        ROUTER_RULE,
        *TRAINING_LAYOUT_RULES,
    ))

    model: ModelSource
    workload: Workload = Field(Workload.INFERENCE, description=(
        "inference serves the OpenAI-compatible API; training trains and writes sharded checkpoints."))
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description=(
        "Weight dtype on the GPU. auto: the dtype in the model's config (bfloat16 when unknown)."))
    parallelism: Parallelism = Field(default_factory=Parallelism, json_schema_extra={"default": {}})
    gpu: GPU = Field(default_factory=GPU, json_schema_extra={"default": {}})
    placement: Placement = Field(default_factory=Placement, json_schema_extra={"default": {}})
    training: Optional[Training] = Field(None, description="The data and hyperparameters of a training workload.")
    checkpoint: Optional[Checkpoint] = Field(None, description="Sharded checkpoints (training; resume after failure).")
    recovery: Recovery = Field(default_factory=Recovery, json_schema_extra={"default": {}})
    serving: Serving = Field(default_factory=Serving, json_schema_extra={"default": {}})
    autoscaling: Optional[Autoscaling] = Field(None, description=(
        "Serving: size parallelism.replicas from the replicas' load (docs/operator.md, Autoscaling). Omitted: "
        "replicas are the user's (`kubectl scale`, or an HPA on the scale subresource)."))
    rollout: Rollout = Field(default_factory=Rollout, json_schema_extra={"default": {}}, description=(
        "Serving: how a new layout, image or spec replaces the replicas (docs/operator.md, Rollouts)."))
    image: Optional[str] = Field(None, max_length=1024, description="Worker image; the operator's default when omitted.")
    resources: Optional[Resources] = None

    @model_validator(mode="after")
    def _cross_checks(self) -> "ShardedModelSpec":
        tp, m = self.parallelism.tensor, self.model
        for name, count in (("heads", m.heads), ("kvHeads", m.kv_heads)):
            if tp and count and count % tp:
                raise ValueError(f"parallelism.tensor must divide model.{name}")
        if self.parallelism.pipeline and m.layers and self.parallelism.pipeline > m.layers:
            raise ValueError("parallelism.pipeline must not exceed model.layers")
        if self.resources and self.gpu.resource_name in {**self.resources.limits, **self.resources.requests}:
            raise ValueError("resources must not name the GPU resource; the plan sets the GPU count")
        if self.workload == Workload.TRAINING:
            if self.training is None:
                raise ValueError("workload training needs spec.training (at least data and steps)")
            if self.checkpoint is None or not (self.checkpoint.claim or self.checkpoint.uri):
                raise ValueError(TRAINING_NEEDS_SHARED_TIER)
        elif self.training is not None:
            raise ValueError("spec.training is only for workload: training")
        if self.autoscaling is not None and self.workload == Workload.TRAINING:
            raise ValueError(AUTOSCALING_SERVING_ONLY)
        router_check(self.serving.router, self.workload == Workload.TRAINING)
        if self.training is not None:
            check_training_layout(self.training, self.parallelism.replicas, self.parallelism.pipeline)
        return self

    def min_replicas(self) -> int:
        """The fewest replicas a training job may run with: training.minReplicas, else all of them."""
        replicas = self.parallelism.replicas
        floor = self.training.min_replicas if self.workload == Workload.TRAINING and self.training else None
        return min(floor or replicas, replicas)

    def context_parallel(self) -> int:
        """Replicas each sequence is split over (training.contextParallel; 1 when not training)."""
        return self.training.context_parallel if self.workload == Workload.TRAINING and self.training else 1


# ---------------------------------------------------------------- status


NAME_TOO_LONG = (f"metadata.name must be at most {MAX_MODEL_NAME} characters: the model's pods "
                 f"(<name>-r<replica>-s<stage>) and Services (<name>-ranks) are named from it")
NAME_NOT_DNS_LABEL = ("metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting "
                      "with a letter, ending with a letter or digit): it names the model's Service")


def model_name_problem(name: str) -> str:
    """Why a ShardedModel cannot have this name ("" when it can): the CRD's root rules, in Python."""
    if len(name) > MAX_MODEL_NAME:
        return NAME_TOO_LONG
    if not re.match(MODEL_NAME_PATTERN, name):
        return NAME_NOT_DNS_LABEL
    return ""


class ShardedModel(ApiModel):
    # On the CRD's root: every object the model makes is named from its name (crds/names.py).
    model_config = ConfigDict(json_schema_extra=cel(
        (f"size(self.metadata.name) <= {MAX_MODEL_NAME}", NAME_TOO_LONG),
        (f"self.metadata.name.matches('{MODEL_NAME_PATTERN}')", NAME_NOT_DNS_LABEL),
    ))

    api_version: Literal["shardwise.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["ShardedModel"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ShardedModelSpec
    status: Optional[ShardedModelStatus] = None

    @property
    def name(self) -> str:
        return self.metadata.get("name", "")

    @property
    def namespace(self) -> str:
        return self.metadata.get("namespace", "default")

    @model_validator(mode="after")
    def _name_makes_valid_names(self) -> "ShardedModel":
        problem = model_name_problem(self.name) if self.name else ""
        if problem:
            raise ValueError(problem)
        return self


def load_manifest(data: dict[str, Any]) -> ShardedModel:
    """A ShardedModel from a manifest dict; raises ValueError with one line naming the bad field."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise ValueError("manifest is not a mapping")
    if data.get("kind") not in (None, KIND):
        raise ValueError(f"kind is {data.get('kind')!r}, expected {KIND}")
    try:
        return ShardedModel.model_validate(data)
    except ValidationError as e:
        raise ValueError(describe_validation_error(e)) from None
