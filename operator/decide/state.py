"""What the reconciler knows of one ShardedModel at the start of a pass: the typed `ModelState` that
controller/observe.py reads from the API server and the pure `decisions.decide()` works on.

Everything comes from the API server, so a restarted operator sees what the last one left:
  - the ShardedModel: its typed spec (one parse; every default is the API model's) and its status
    (the per-group records, the cached model facts, the last conditions);
  - the plan: the whole ShardPlan, read back from the plan ConfigMap the pods read it from, so what
    the operator reasons about is exactly what its pods run (status.plan is only a summary for users);
  - the pods: this model's replica pods by replica, its model-shape probe pod, if any, and its
    pre-pull pods (spec.model.prePull).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from shardwise.crds import names
from shardwise.crds.models import (ModelFactsStatus, ReplicaGroupStatus, ShardedModel, ShardedModelSpec,
                                   describe_validation_error, model_name_problem)
from shardwise.crds.modelshape import ModelFacts, ModelFactsError, from_hints
from shardwise.crds.plan import ShardPlan
from shardwise.operator.decide import probe
from shardwise.operator.render import localtier, prepull, renderer, settings
from shardwise.operator.decide.recovery import Policy
from shardwise.operator.decide.workloads import Workload, workload_of

log = logging.getLogger("shardwise.operator")
# Reads a model's shape where the operator may (controller/modelroot.py): facts, a reason, or None.
ModelReader = Callable[[ShardedModelSpec], "ModelFacts | str | None"]


@dataclasses.dataclass(frozen=True)
class ModelState:
    """One ShardedModel as observed. `invalid` is set (and `model` is None) when the spec does not
    parse: nothing else is read then."""

    namespace: str
    name: str
    generation: int | None
    status: Mapping[str, Any]                       # the status as stored (conditions, training...)
    model: ShardedModel | None = None
    invalid: str = ""
    plan: ShardPlan | None = None                   # the stored plan, as the pods read it
    groups: Mapping[int, ReplicaGroupStatus] = dataclasses.field(default_factory=dict)
    pods: Mapping[int, list[dict]] = dataclasses.field(default_factory=dict)   # replica -> its pods
    probe_pod: dict | None = None                   # the model-shape probe, while it exists
    prepull_pods: tuple[dict, ...] = ()             # pre-pull pods (spec.model.prePull), while they exist
    facts: ModelFactsStatus | None = None           # the cached read of the model (a probe's)
    local_facts: ModelFacts | None = None           # the model's shape from hints or the model root
    facts_error: str = ""                           # why those cannot be had (None and "": probe it)
    default_image: str = renderer.DEFAULT_IMAGE
    version: str = ""                               # metadata.resourceVersion read: status writes need it

    @property
    def spec(self) -> ShardedModelSpec:
        assert self.model is not None, "an invalid spec has no typed model"
        return self.model.spec

    @property
    def workload(self) -> Workload:
        return workload_of(self.spec)

    @property
    def policy(self) -> Policy:
        return Policy.from_spec(self.spec.recovery)

    @property
    def desired(self) -> int:
        return self.spec.parallelism.replicas

    @property
    def spec_changed(self) -> bool:
        """A new generation since the last pass that wrote status."""
        seen = self.status.get("observedGeneration")
        return seen is not None and seen != self.generation

    @functools.cached_property
    def spec_hash(self) -> str:   # asked for once per replica: computed once
        return renderer.spec_hash(self.spec, self.default_image)


def parse_state(body: Mapping[str, Any], pods: list[dict], configmap: Mapping[str, Any] | None,
                default_image: str = renderer.DEFAULT_IMAGE, read_model: ModelReader | None = None) -> ModelState:
    """The typed state from what the API server returned (pure: the unit tests build states here)."""
    meta, status = body["metadata"], dict(body.get("status") or {})
    base = dict(namespace=meta["namespace"], name=meta["name"], generation=meta.get("generation"),
                status=status, default_image=default_image, version=meta.get("resourceVersion") or "")
    try:
        spec = ShardedModelSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        # What the schema could not catch ends in a condition, never in a crash loop.
        return ModelState(**base, invalid=f"invalid spec: {describe_validation_error(e)}")
    bad_name = model_name_problem(meta["name"])
    if bad_name:   # made before the API server checked names: nothing it would make is valid
        return ModelState(**base, invalid=bad_name)
    refused = localtier.refusal(spec, settings.current().local_checkpoint_roots)
    if refused:    # a node directory the operator does not allow: no pod mounts it
        return ModelState(**base, invalid=refused)
    replica_pods: dict[int, list[dict]] = {}
    probe_pod, prepulls = None, []
    for pod in _owned(pods, meta.get("uid")):
        if probe.is_probe(pod):
            probe_pod = pod
            continue
        if prepull.is_prepull(pod):
            prepulls.append(pod)
            continue
        replica = int(pod["metadata"]["labels"].get(names.LABEL_REPLICA, -1))
        replica_pods.setdefault(replica, []).append(pod)
    local, error = _local_facts(spec, read_model)
    return ModelState(**base, model=ShardedModel(metadata=dict(meta), spec=spec),
                      plan=renderer.plan_from_configmap(configmap), groups=_groups(status),
                      pods=replica_pods, probe_pod=probe_pod, prepull_pods=tuple(prepulls), facts=_facts(status),
                      local_facts=local, facts_error=error)


def _local_facts(spec: ShardedModelSpec, read_model: ModelReader | None) -> tuple[ModelFacts | None, str]:
    """The model's shape without a probe: the spec's hints (all of parameters, layers and heads), else
    what `read_model` read inside the operator's model root (controller/modelroot.py). (None, "")
    when neither has it: the probe pod reads it where the pods would. The operator never opens a
    path a tenant names anywhere else."""
    model = spec.model
    try:
        if model.parameters and model.layers and model.heads:
            found: ModelFacts | str | None = from_hints(model, spec.dtype)
        else:
            found = read_model(spec) if read_model is not None else None
    except ModelFactsError as e:
        return None, str(e)
    if isinstance(found, ModelFacts):
        problem = probe.out_of_bounds(found)
        return (None, problem) if problem else (found, "")
    return None, found or ""


def _owned(pods: list[dict], uid: str | None) -> list[dict]:
    """The model's own pods: those with its ownerReference. A pod carrying the model's labels is
    anyone's to make in the namespace; the operator neither counts nor deletes one it did not make."""
    if uid is None:   # a body without a uid (built by hand): every pod listed is taken as the model's
        return list(pods)
    return [p for p in pods if any(ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or [])]


def _groups(status: Mapping[str, Any]) -> dict[int, ReplicaGroupStatus]:
    out = {}
    for item in status.get("groups") or []:
        try:
            g = ReplicaGroupStatus.model_validate(item)
        except ValidationError:
            log.warning(f"ignoring a group record the operator cannot read: {item}")
            continue
        out[g.replica] = g
    return out


def _facts(status: Mapping[str, Any]) -> ModelFactsStatus | None:
    try:
        return ModelFactsStatus.model_validate(status["modelFacts"]) if status.get("modelFacts") else None
    except ValidationError:
        return None
