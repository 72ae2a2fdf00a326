"""The pod contract: everything the operator tells a worker pod, in one validated file.

The renderer (operator/render/renderer.py) writes it gzip-compressed as `contract.json.gz` in the
model's ConfigMap, mounted in every pod at /etc/shardwise/contract.json.gz (crds/names.py
CONTRACT_PATH); `shardwise worker --contract PATH` reads it with `load_contract`, which takes plain
JSON as well (a contract written by hand) and tells the two apart by gzip's magic bytes. The
ConfigMap is shared by all the pods of a model, so what differs from pod to pod stays in their
environment (crds/names.py ENV_*): SHARDWISE_REPLICA, SHARDWISE_STAGE, MASTER_ADDR, MASTER_PORT (the
torch.distributed rendezvous), POD_IP and NODE_NAME.

The fields reuse the API's own models (crds/models.py), so every default has one definition, the
spec's. Paths are paths inside the pod: a pvc:// uri is already resolved to where the renderer
mounts its claim. Importable without torch: the operator writes the file, the worker reads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from shardwise.crds import compressed
from shardwise.crds.models import (Checkpoint, ModelSource, Serving, ShardedModelSpec, Training, Workload,
                                   describe_validation_error)
from shardwise.crds.names import MAX_FETCH_STREAMS
from shardwise.crds.plan import ShardPlan
from shardwise.crds.sourcespec import ModelCache

# A serving pod's terminationGracePeriodSeconds, and how long of it the worker spends draining: on
# SIGTERM it turns unready and finishes its in-flight requests for up to DRAIN_SECONDS, then ends
# what is left and exits, inside the grace period (worker/serving/http/server.py run_engine).
# After the engine is done, the answers still being written get up to FLUSH_SECONDS more (their
# last tokens, or the error that ends them), inside the same grace period (server.py Server.close).
SERVING_GRACE_SECONDS = 10
DRAIN_SECONDS = SERVING_GRACE_SECONDS - 2
FLUSH_SECONDS = 1.5

# The spec's own types: the contract accepts exactly the values the API accepts.
Dtype = ShardedModelSpec.model_fields["dtype"].annotation
ModelFormat = ModelSource.model_fields["format"].annotation


# A contract's JSON at most, read from a file or inflated from gzip: far above what a ConfigMap's 1 MiB
# holds gzipped (about 20 MiB of JSON), low enough that a decompression bomb cannot exhaust a pod.
CONTRACT_MAX_BYTES = 64 << 20


class ContractError(ValueError):
    """A contract that is missing or invalid, as one line naming the file and the first bad field."""


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelContract(_Contract):
    path: str = Field(min_length=1, description=(
        "the weights inside the pod: an HF folder, a .gguf file, or a built-in model name; for a "
        "remote model (see PodContract.source) its uri, fetched into source.cache_dir first"))
    format: ModelFormat = Field(description="spec.model.format; the worker detects the format from the files")
    dtype: Dtype = Field(description="spec.dtype as asked (auto included); the worker resolves auto")


class SourceContract(_Contract):
    """Where a remote model (hf://, s3://, oci://) is fetched from and cached: spec.model's options, with
    no credential (those are the pod's environment, crds/names.py CREDENTIAL_ENV). `model.path` is the
    uri then; the worker fetches its files into cache_dir and loads them from there."""

    uri: str = Field(min_length=1, max_length=4096, description="spec.model.uri")
    scheme: str = Field(pattern=r"^(hf|s3|oci)$", description="the uri's scheme")
    endpoint: Optional[str] = Field(None, max_length=2048, description="spec.model.endpoint (s3://)")
    region: Optional[str] = Field(None, max_length=64, description="spec.model.region (s3://)")
    path_style: Optional[bool] = Field(None, description="spec.model.pathStyle (s3://)")
    cache: ModelCache = Field(description="node: cache_dir is shared by the pods on the node; pod: the pod's own")
    cache_dir: str = Field(pattern=r"^/", max_length=4096, description="the cache inside the pod")
    cache_budget: Optional[int] = Field(None, ge=0, description=(
        "bytes the node's cache may hold (least recently used entries out); None for a pod's own cache"))
    streams: Optional[int] = Field(None, ge=1, le=MAX_FETCH_STREAMS, description=(
        "spec.model.fetchStreams: reads in flight at once while the pod fetches; None: the fetcher's default"))
    plain_http: Optional[bool] = Field(None, description=(
        "oci://: speak plain HTTP to the registry, which the operator's --plain-http-registry lists; "
        "None: HTTPS (plain HTTP to a loopback registry only)"))

    @model_serializer(mode="wrap")
    def _no_unset_additions(self, handler):
        # Unset, they are left out of the file, so that a worker image older than them still reads the
        # contract, and a model whose pods were made before them keeps its pods.
        out = handler(self)
        for key in ("streams", "plain_http"):
            if isinstance(out, dict) and key in out and out[key] is None:
                del out[key]
        return out


class ServingContract(Serving):
    """spec.serving, and the name the OpenAI-compatible API reports. PodContract resolves its
    capacity (crds/capacity.py ServingCapacity.resolved): every setting the engine runs with is in
    the file, the plan's concurrency included, whatever the spec left out."""

    model_name: str = Field(min_length=1, description="the ShardedModel's name")
    # The pod's own arguments and the NetworkPolicy's, not the worker's: never in the file, so that a
    # worker image older than them still reads it.
    auth: None = Field(None, exclude=True)
    allow_from: list = Field(default_factory=list, exclude=True)


class PodContract(_Contract):
    plan: ShardPlan = Field(description="the plan exactly as the planner made it")
    model: ModelContract
    workload: Workload
    serving: ServingContract
    training: Optional[Training] = Field(None, description="spec.training, `data` being the path inside the pod")
    checkpoint: Optional[Checkpoint] = Field(None, description="spec.checkpoint (`path` is inside the pod)")
    termination_log: str = Field(min_length=1, description=(
        "the container's terminationMessagePath: a finished training pod writes its result there"))
    source: Optional[SourceContract] = Field(None, description="a remote model's source and cache")

    @model_serializer(mode="wrap")
    def _no_empty_source(self, handler):
        # A contract of a model in a path or a claim is written as before, without `source`, so that
        # a worker image older than it still reads the file.
        out = handler(self)
        if isinstance(out, dict) and out.get("source", 0) is None:
            del out["source"]
        return out

    @model_validator(mode="after")
    def _training_has_its_options(self) -> "PodContract":
        if self.workload == Workload.TRAINING and (self.training is None or self.checkpoint is None):
            raise ValueError("a training contract needs training and checkpoint")
        return self

    @model_validator(mode="after")
    def _serving_settings_resolved(self) -> "PodContract":
        for field, value in self.serving.resolved(self.plan.max_sequences).items():
            setattr(self.serving, field, value)
        return self

    def to_json(self) -> str:
        # Field names, not the API's camelCase aliases: the plan inside has no aliases either.
        return self.model_dump_json(indent=2)

    def to_gzip(self) -> bytes:
        """The ConfigMap's form: compact JSON, gzip-compressed (what `load_contract` reads)."""
        return compressed.compress(self.model_dump_json().encode())

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "the JSON") -> "PodContract":
        """Parse and validate; raises ContractError (one line) on anything else."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise ContractError(f"{where} is not a valid pod contract: {describe_validation_error(e)}") from None


def load_contract(path: str | Path) -> PodContract:
    """The contract file a worker pod is started with, plain JSON or gzip; ContractError when
    missing, invalid or over CONTRACT_MAX_BYTES."""
    try:
        with open(path, "rb") as f:
            data = f.read(CONTRACT_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ContractError(f"pod contract {path} not found") from None
    except OSError as e:
        raise ContractError(f"pod contract {path} cannot be read: {e.strerror or e}") from None
    return PodContract.from_json(contract_json(data, where=f"pod contract {path}"), where=str(path))


def contract_json(data: bytes, where: str) -> bytes:
    """A contract's JSON from its stored bytes: gzip (told by its magic bytes) inflated, plain JSON
    as it is, either at most CONTRACT_MAX_BYTES; ContractError (one line starting with `where`)."""
    if compressed.is_gzip(data):
        try:
            return compressed.decompress(data, CONTRACT_MAX_BYTES)
        except compressed.Unreadable as e:
            raise ContractError(f"{where} {e}") from None
    if len(data) > CONTRACT_MAX_BYTES:
        raise ContractError(f"{where} is larger than {CONTRACT_MAX_BYTES >> 20} MiB")
    return data
