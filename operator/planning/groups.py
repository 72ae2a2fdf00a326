"""Planning replica groups: how the operator asks the planner for a ShardPlan of some groups while
the others keep theirs, and how the stored plan is merged with it or loses replicas.

The planner (planner.plan) takes the spec, the model facts, the inventory and placements to keep. The
operator plans only the groups that need it - a new model, a scaled-up replica, a group recovering
from a failure - and keeps the others where they run. A recovering group is first offered the
topology domain it ran in (its rack, when the rack still has room), so that a node loss inside a rack
keeps the group inside that rack; only if nothing fits there does it move, whole, to another domain.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from shardwise.crds import names
from shardwise.crds.models import ShardedModelSpec
from shardwise.crds.modelshape import ModelFacts
from shardwise.crds.plan import ShardPlan, StagePlacement
from shardwise.operator.planning import inventory
from shardwise.operator.planning import planner


class PlanFailure(Exception):
    """No plan for the groups asked for; str(error) is one sentence saying why."""


class InvalidSpec(PlanFailure):
    """The spec (or the model it names) cannot run at all: terminal until the spec changes."""


class ShortOfCapacity(PlanFailure):
    """Not enough healthy capacity now: retried as nodes come and go."""


def plan_groups(spec: ShardedModelSpec, facts: ModelFacts, namespace: str, model: str,
                nodes: Mapping[str, Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], replicas: Sequence[int],
                current: ShardPlan | None, keep: Iterable[int],
                previous: Mapping[int, Sequence[str]] | None = None, warm: Iterable[str] = ()) -> ShardPlan:
    """A plan holding placements for `replicas` (numbered as asked), other groups in `keep` staying
    where `current` has them; InvalidSpec or ShortOfCapacity when there is none. `pods`: every live
    GPU pod of the cluster (ours included: this model's pods are told apart by label and owner). `previous`:
    replica -> nodes it ran on (domain preference). `warm`: nodes whose node-local cache holds the
    model's files (status.nodeCache), preferred among otherwise equal placements."""
    keep = [r for r in keep if current is not None]
    kept = [p for p in (current.placements if current else []) if p.replica in keep]
    same_layout = current is not None and layout_matches(current, spec)
    # This model's pods of the groups being planned or kept are left out of the inventory (the
    # planner subtracts kept placements itself); its other pods - groups on an old layout still
    # serving during a roll - hold their GPUs like any other workload.
    mine = {str(r) for r in replicas} | {str(r) for r in keep}

    def own(p: Mapping[str, Any]) -> bool:
        labels = p.get("metadata", {}).get("labels") or {}
        return (p.get("metadata", {}).get("namespace") == namespace and labels.get(names.LABEL_MODEL) == model
                and labels.get(names.LABEL_REPLICA, "") in mine and inventory.made_by_operator(p))
    pods, warm = list(pods), frozenset(warm)
    infos = inventory.build(nodes.values(), pods, spec.gpu.resource_name, ignore_pod=own)
    if kept and not same_layout:
        # Layout change rolling through: the old groups hold their GPUs like any other workload.
        infos = _subtract(infos, kept)
        kept = []
    # Kept groups on nodes that are no longer usable will recover in their own turn; don't let them
    # veto this plan.
    ready = {n.name for n in infos if n.ready and not n.unschedulable}
    by_replica: dict[int, list[StagePlacement]] = {}
    for p in kept:
        by_replica.setdefault(p.replica, []).append(p)
    kept = [p for r, ps in by_replica.items() if all(q.node in ready for q in ps) for p in ps]
    n_kept = len({p.replica for p in kept})
    asked = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(
        update={"replicas": n_kept + len(replicas)})})

    def attempt(candidates: Sequence[inventory.NodeInfo]) -> ShardPlan:
        return planner.plan(asked, facts, candidates, keep=kept, warm=warm)

    plan = None
    domain_nodes = _previous_domain(infos, spec, previous, replicas)
    if domain_nodes:
        try:
            plan = attempt([n for n in infos if n.name in domain_nodes or n.name in {p.node for p in kept}])
        except planner.PlanError:
            plan = None
    if plan is None:
        try:
            plan = attempt(infos)
        except planner.LayoutError as e:
            raise InvalidSpec(str(e)) from None
        except planner.PlanError as e:
            raise ShortOfCapacity(str(e)) from None
    return _renumber(plan, {p.replica for p in kept}, list(replicas))


def layout_matches(plan: ShardPlan, spec: ShardedModelSpec) -> bool:
    """The plan has the layout the spec asks for (an omitted degree matches any), the ZeRO-3 shard
    degree and the context-parallel degree of a training job included."""
    t, p, s = spec.parallelism.tensor, spec.parallelism.pipeline, asked_shard(spec)
    return ((t is None or t == plan.tensor) and (p is None or p == plan.pipeline) and (s is None or s == plan.data_shard)
            and plan.context == spec.context_parallel())


def asked_shard(spec: ShardedModelSpec) -> int | None:
    """The ZeRO-3 shard degree the spec fixes, or None (also for one that does not split the
    replicas: the planner says so when it plans)."""
    try:
        return planner.asked_shard(spec)
    except planner.LayoutError:
        return None


def _subtract(infos: list[inventory.NodeInfo], placements: Iterable[StagePlacement]) -> list[inventory.NodeInfo]:
    used: dict[str, int] = {}
    for p in placements:
        used[p.node] = used.get(p.node, 0) + p.gpus
    return [inventory.NodeInfo(**{**n.__dict__, "used": n.used + used.get(n.name, 0)}) for n in infos]


def _previous_domain(infos: Sequence[inventory.NodeInfo], spec: ShardedModelSpec,
                     previous: Mapping[int, Sequence[str]] | None, replicas: Sequence[int]) -> set[str]:
    """Nodes of the tightest topology domain (first topology key) a single recovering group ran in."""
    if not previous or len(replicas) != 1 or not spec.placement.topology_keys:
        return set()
    old = list(previous.get(replicas[0]) or [])
    if not old:
        return set()
    key = spec.placement.topology_keys[0]
    labels = {n.name: n.labels for n in infos}
    values = {labels[n].get(key) for n in old if n in labels}
    values.discard(None)
    if len(values) != 1:
        return set()
    value = values.pop()
    return {n.name for n in infos if n.labels.get(key) == value}


def _renumber(plan: ShardPlan, kept: set[int], wanted: list[int]) -> ShardPlan:
    """The planner numbers new groups from the lowest free index; give them the numbers asked for."""
    new = sorted({p.replica for p in plan.placements} - kept)
    mapping = dict(zip(new, wanted))
    placements = [p.model_copy(update={"replica": mapping[p.replica]}) for p in plan.placements
                  if p.replica in mapping]
    groups = [g.model_copy(update={"replica": mapping[g.replica]}) for g in plan.groups if g.replica in mapping]
    return plan.model_copy(update={"placements": placements, "groups": groups, "replicas": len(groups),
                                   "cost": sum(g.cost for g in groups)})


def planned(plan: ShardPlan | None) -> set[int]:
    """The replicas a plan places."""
    return {p.replica for p in plan.placements} if plan is not None else set()


def merge_plan(base: ShardPlan | None, new: ShardPlan, replicas: set[int]) -> ShardPlan:
    """`new` for `replicas`, and `base` for the others when it has the same layout."""
    same = base is not None and (base.tensor, base.pipeline, base.num_layers) == (new.tensor, new.pipeline,
                                                                                  new.num_layers)
    keep = [p for p in base.placements if p.replica not in replicas] if same and base else []
    kept_groups = [g for g in base.groups if g.replica not in replicas] if same and base else []
    placements = keep + [p for p in new.placements if p.replica in replicas]
    groups = sorted(kept_groups + [g for g in new.groups if g.replica in replicas], key=lambda g: g.replica)
    return new.model_copy(update={"placements": placements, "groups": groups,
                                  "replicas": len({p.replica for p in placements}),
                                  "cost": sum(g.cost for g in groups)})


def drop_replicas(plan: ShardPlan | None, replicas: set[int]) -> ShardPlan | None:
    """The plan without `replicas` (possibly with no placements left: the layout stays stored)."""
    if plan is None:
        return None
    placements = [p for p in plan.placements if p.replica not in replicas]
    groups = [g for g in plan.groups if g.replica not in replicas]
    return plan.model_copy(update={"placements": placements, "groups": groups,
                                   "replicas": len({p.replica for p in placements}),
                                   "cost": sum(g.cost for g in groups)})
