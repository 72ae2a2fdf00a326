"""The ShardPlan's model: the plan the planner makes, which the operator stores and the worker reads.

The plan is the contract between the planner (pure), the renderer (pods from the plan) and the
worker (which layers and which slice of each weight a rank owns). It travels to the pods inside the
pod contract (crds/contract.py, `contract.json.gz` in a ConfigMap), so both sides validate it with this
one model.

Ranks: crds/layout.py RankLayout. Inside one replica (one torch.distributed world per replica)
consecutive ranks are one stage's TP group; training makes one world of all replicas and averages
gradients across them (data parallel): ZeRO-3 shards the model's training state over `data_shard`
replicas, and `data_replicate` such groups hold copies (HSDP). The layer ranges come from
crds/layout.py split_layers.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from shardwise.crds.layout import RankLayout
from shardwise.crds.training import MAX_CONTEXT_PARALLEL


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StagePlacement(_Model):
    """One pipeline stage of one replica: one pod on one node, holding `tensor` GPUs."""

    replica: int = Field(ge=0)
    stage: int = Field(ge=0)
    node: str
    gpus: int = Field(ge=1, description="GPUs the pod asks for: the tensor-parallel degree")
    layer_start: int = Field(ge=0, description="first decoder layer this stage owns")
    layer_end: int = Field(ge=0, description="one past the last decoder layer this stage owns")
    embedding: bool = Field(description="this stage holds the token embedding (stage 0)")
    head: bool = Field(description="this stage holds the final norm and LM head (last stage)")
    params: int = Field(0, ge=0, description="parameters this stage holds, for balance reporting")
    domains: dict[str, str] = Field(default_factory=dict,
                                    description="topology key -> value of the node, tightest first")

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


class ReplicaPlan(_Model):
    replica: int = Field(ge=0)
    domain: str = Field("", description="the tightest topology domain holding every stage")
    cost: int = Field(0, ge=0, description="topology boundaries crossed between consecutive stages")
    explanation: str = ""


class ShardPlan(_Model):
    tensor: int = Field(ge=1)
    pipeline: int = Field(ge=1)
    replicas: int = Field(ge=0)
    num_layers: int = Field(ge=1)
    placements: list[StagePlacement] = Field(default_factory=list)
    groups: list[ReplicaPlan] = Field(default_factory=list)
    cost: int = Field(0, ge=0, description="sum of the replicas' costs")
    shrunk: bool = Field(False, description="fewer replicas or another layout than asked, for lack of capacity")
    notes: list[str] = Field(default_factory=list)
    memory_per_gpu: int = Field(0, ge=0, description="bytes of GPU memory each rank is expected to use (planner estimate)")
    topology_keys: list[str] = Field(default_factory=list, description="label keys of StagePlacement.domains, tightest first")
    quantization: str = Field("none", description=(
        "serving: how the workers hold the weights, as the planner sized them (none or int8; "
        "spec.serving.quantization auto resolved)"))
    offload_budget: int = Field(0, ge=0, description=(
        "serving with spec.serving.offload: bytes of weights each GPU keeps resident, the other "
        "decoder layers streamed from host memory (worker/weights/offload.py); 0: every weight resident"))
    max_sequences: int = Field(0, ge=0, description=(
        "serving: sequences each replica runs at once, spec.serving.maxConcurrentRequests or derived "
        "from the KV cache the plan sized (crds/capacity.py derived_sequences); 0 in a plan made "
        "before it was planned (the contract then derives it the same way)"))
    data_shard: int = Field(1, ge=1, description=(
        "training: the ZeRO-3 shard degree - data-parallel replicas that shard parameters, gradients "
        "and optimizer state among themselves (replicas = data_shard x data_replicate); 1 for serving. "
        "With context parallelism a multiple of `context`: FSDP shards over dp_shard x cp"))
    context: int = Field(1, ge=1, le=MAX_CONTEXT_PARALLEL, description=(
        "training: replicas each sequence is split over (spec.training.contextParallel): consecutive "
        "replicas r, r+1, ... r+context-1 (r a multiple of context) hold one sequence; the data-parallel "
        "replicas are replicas / context. 1 for serving"))

    @model_serializer(mode="wrap")
    def _no_default_context(self, handler):
        # Left out at 1, so that a plan without context parallelism hashes as before (its pods do
        # not roll) and a worker image older than the field still reads it.
        out = handler(self)
        if isinstance(out, dict) and self.context == 1:
            out.pop("context", None)
        return out

    @model_validator(mode="after")
    def _shards_whole_sequences(self) -> "ShardPlan":
        if self.data_shard % self.context:
            raise ValueError(f"data_shard {self.data_shard} must be a multiple of context {self.context}: "
                             f"FSDP shards over the data-parallel shard ranks x the context-parallel ranks")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of one replica's world (what an inference pod joins)."""
        return RankLayout(self.tensor, self.pipeline).world_size

    @property
    def data_replicate(self) -> int:
        """Training: copies of the ZeRO-3-sharded model whose gradients are averaged (HSDP), >= 1."""
        return max(1, self.replicas // self.data_shard)

    def stages_of(self, replica: int) -> list[StagePlacement]:
        return sorted((p for p in self.placements if p.replica == replica), key=lambda p: p.stage)

    def placement(self, replica: int, stage: int) -> StagePlacement:
        for p in self.placements:
            if p.replica == replica and p.stage == stage:
                return p
        raise KeyError(f"plan has no replica {replica} stage {stage}")

    @model_validator(mode="after")
    def _stages_cover_layers(self) -> "ShardPlan":
        by_replica: dict[int, list[StagePlacement]] = {}
        for p in self.placements:  # grouped once: plans with thousands of replicas stay linear
            by_replica.setdefault(p.replica, []).append(p)
        for r, stages in by_replica.items():
            stages.sort(key=lambda p: p.stage)
            if [p.stage for p in stages] != list(range(self.pipeline)):
                raise ValueError(f"replica {r} must have stages 0..{self.pipeline - 1}")
            edge = 0
            for p in stages:
                if p.layer_start != edge or p.layer_end <= p.layer_start:
                    raise ValueError(f"replica {r} stage {p.stage}: layers must be contiguous and non-empty")
                edge = p.layer_end
            if edge != self.num_layers:
                raise ValueError(f"replica {r}: stages cover {edge} of {self.num_layers} layers")
        return self
