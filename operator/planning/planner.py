"""The planner: spec × model facts × nodes × kept placements -> the ShardPlan (crds/plan.py).

A pure function. The operator calls it on every (re-)plan; `shardwise plan` calls it offline.
Layouts and their memory are in layouts.py, the choice of nodes in placement.py; this module tries
the variants (quantization, offload), keeps replicas, and assembles and explains the plan.

How it decides
1. Layout. Tensor degree (TP) must divide the attention and KV heads and fit on one node; when
   omitted, the smallest TP whose single stage fits a GPU is chosen (pipeline 1); when no TP fits
   a whole model, the fewest pipeline stages (PP) that fit, largest TP first. Memory per GPU =
   weights/TP + KV cache + activations (inference), or the ZeRO-3 training state of
   training_state_bytes + activations (training), + a fixed CUDA overhead, against 90% of the
   GPU's memory. Training shards its state over S data-parallel replicas: the S the spec fixes,
   else the smallest divisor of the replicas at which enough GPUs hold the layout for all the
   replicas (ShardPlan.data_shard).
2. Slots. A node with F free GPUs offers F // TP slots; one slot holds one stage (one pod), so a
   TP group never spans nodes.
3. Placement. Each replica takes PP slots. Its cost is the topology boundaries crossed between
   consecutive stages: 1 per node change, +1 per rack change, +1 per zone change (the keys in
   spec.placement.topologyKeys). Ordering a replica's slots domain by domain makes its cost
       (nodes - 1) + (racks - 1) + (zones - 1),
   so the cheapest slot set is found exactly by a small dynamic programme over the topology tree
   (per domain: best objective for taking k = 0..PP slots inside it). Ties break towards domains
   no other replica uses (spread for availability) - for training, towards the domains the other
   replicas use (they all-reduce gradients every step: the job packs close together) - then
   towards warm nodes (whose node-local cache holds the model's files: `warm`), then towards nodes
   the replica fills (best fit, keeping big blocks whole), then by name (determinism). Replicas are placed one after the
   other; only the domains a placed replica touched are recomputed, which keeps 1,000 nodes fast.
4. Layers. Split contiguously so stages hold equal parameters, counting the embedding on the
   first stage and the final norm + LM head on the last (crds/layout.py: the worker splits a
   local run the same way).
5. Concurrency (serving). The sequences a replica runs at once: spec.serving.maxConcurrentRequests,
   else derived from the KV cache sized in 1 (crds/capacity.py derived_sequences):
       clamp(kvCacheTokens // min(512, maxModelLength), 1, 256)     (8 when kvCacheTokens is 0)
   The pods run that many rows; more sequences than the cache holds are preempted and resumed.
Weights are sized in the dtype the worker will hold them in on a GPU (crds/modelshape.py
in_memory_dtype: a quantized GGUF is dequantized, so it takes bfloat16's room, not its file's),
or as spec.serving.quantization holds them (ModelFacts.quantized: int8, or gguf - a Q8_0, Q4_0 or
Q4_1 file's layer matrices kept in its blocks, GGUF_NATIVE_BYTES).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from shardwise.crds import names
from shardwise.crds.capacity import MAX_DERIVED_SEQUENCES, typical_tokens
from shardwise.crds.models import ShardedModelSpec, Workload
from shardwise.crds.modelshape import GGUF_NATIVE_BYTES, ModelFacts, ModelFactsError
from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
from shardwise.operator.planning.inventory import NodeInfo, usable
from shardwise.operator.planning.layouts import (PLAN_SECONDS, GiB, USABLE_FRACTION, Deadline, Layout, LayoutError,
                                                 PlanError, asked_shard, check_layout, layouts_to_try, offload_budget,
                                                 sharded, weight_bytes)
from shardwise.operator.planning.placement import Attempt, Tree, place

__all__ = ["GiB", "LayoutError", "PlanError", "asked_shard", "plan", "variants"]


def plan(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo],
         keep: Sequence[StagePlacement] = (), seconds: float | None = PLAN_SECONDS,
         warm: Iterable[str] = ()) -> ShardPlan:
    """The plan for `spec`, or PlanError with a one-sentence reason.

    `nodes` is the inventory with GPUs of other workloads already subtracted and this model's own
    pods *not* subtracted; `keep` are placements of this model's replicas that must stay where
    they are (the operator re-plans one replica at a time). Their GPUs are subtracted here.

    Inference may hold the weights quantized (spec.serving.quantization: a GGUF's own blocks or
    INT8) and stream layers from host memory (spec.serving.offload). They are tried in `variants`
    order, the first plan that places every replica taken, else the one placing most; a plan that
    is not the first variant's says in its first note what it changed and why. A quantization the
    model cannot have (gguf of a model not stored as Q8_0, Q4_0 or Q4_1) is a LayoutError. A search
    longer than `seconds` (all variants together) is a PlanError saying so. `warm`: nodes whose
    node-local cache holds the model's files, preferred among otherwise equal placements.
    """
    deadline = Deadline(seconds)
    warm = frozenset(warm)
    tried: list[tuple[str, bool, ShardPlan | None, str]] = []
    for quantization, offload in variants(spec, facts):
        try:
            sized = facts.quantized(quantization)
        except ModelFactsError as e:   # gguf asked of a model not stored in such blocks: name the field
            raise LayoutError(f"serving.{e}") from None
        try:
            result = _plan(spec, sized, nodes, keep, quantization, offload, deadline, warm)
        except LayoutError:
            raise                  # degrees that do not fit the model: no variant changes that
        except PlanError as e:
            tried.append((quantization, offload, None, str(e)))
            continue
        why = next((n for n in result.notes if n.startswith("shrunk to")), "")
        tried.append((quantization, offload, result, why))
        if not result.shrunk:
            break
    placed = [t for t in tried if t[2] is not None]
    if not placed:
        raise PlanError(tried[0][3])
    quantization, offload, best, _ = max(placed, key=lambda t: t[2].replicas)   # first among equals
    if (quantization, offload) != tried[0][:2]:
        best.notes.insert(0, _variant_note(spec, facts, quantization, offload, best, tried[0][3]))
    return best


def variants(spec: ShardedModelSpec, facts: ModelFacts) -> list[tuple[str, bool]]:
    """(quantization, offload) pairs to plan with, preferred first. `auto`: the dtype, then a GGUF's
    own blocks when the model is stored in Q8_0, Q4_0 or Q4_1 (no requantization, the file's own
    values), then INT8; quantized before streaming (it keeps decode on the GPU's memory bandwidth;
    streaming is bound by the host link)."""
    if spec.workload == Workload.TRAINING:
        return [("none", False)]
    asked = spec.serving.quantization.value
    if asked == "auto":
        quantizations = ["none"] + ([] if facts.experts else            # (MoE layers: not quantized yet)
                                    (["gguf"] if facts.dtype in GGUF_NATIVE_BYTES else []) + ["int8"])
    else:
        quantizations = [asked]
    out = [(q, False) for q in quantizations]
    if spec.serving.offload:   # streaming with the fewest bytes to stream (a Q4 GGUF's blocks beat INT8)
        out.append((min(quantizations[1:], key=lambda q: facts.quantized(q).bytes_per_param)
                    if len(quantizations) > 1 else quantizations[0], True))
    return out


def _variant_note(spec: ShardedModelSpec, facts: ModelFacts, quantization: str, offload: bool,
                  result: ShardPlan, why: str) -> str:
    changes = []
    asked = spec.serving.quantization.value
    if quantization != "none" and asked == "auto":
        changes.append(f"{quantization} weights (serving.quantization auto; {facts.bytes_per_param:g} -> "
                       f"{facts.quantized(quantization).bytes_per_param:.2f} bytes a parameter)")
    if offload:
        changes.append(f"{result.offload_budget / GiB:.1f} GiB of weights resident per GPU, the other decoder "
                       f"layers streamed from host memory (serving.offload)")
    first = f"in {asked}" if asked in ("int8", "gguf") else f"at dtype {spec.dtype}"
    return f"{' and '.join(changes)}, since {first}: {why}"


def _plan(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo],
          keep: Sequence[StagePlacement], quantization: str, offload: bool, deadline: Deadline,
          warm: frozenset[str] = frozenset()) -> ShardPlan:
    """The plan with the weights sized as `facts` says, streaming layers when `offload`."""
    if spec.workload != Workload.TRAINING and spec.serving.offload != offload:
        spec = spec.model_copy(update={"serving": spec.serving.model_copy(update={"offload": offload})})
    check_layout(spec, facts)
    pool = usable(nodes, spec)
    by_name = {n.name: n for n in pool.nodes}
    notes = []
    if pool.excluded:
        notes.append(f"left out {sum(pool.excluded.values())} node(s): {pool.why_not()}")

    wanted = spec.parallelism.replicas
    kept = _kept_replicas(keep, wanted, by_name, nodes)
    used: dict[str, int] = {}
    for stages in kept.values():
        for p in stages:
            used[p.node] = used.get(p.node, 0) + p.gpus
    count = wanted - len(kept)

    layouts = layouts_to_try(spec, facts, pool, kept, wanted, deadline)
    unknown = sum(1 for n in pool.nodes if not n.gpu_memory)
    if unknown:
        notes.append(f"GPU memory unknown on {unknown} node(s) (no {names.GPU_MEMORY_LABEL} label; set "
                     f"spec.gpu.minMemory): assumed large enough")
    keys = spec.placement.topology_keys
    keep_nodes = [[p.node for p in stages] for stages in kept.values()]

    attempts: list[Attempt] = []
    chosen: Attempt | None = None
    for layout in layouts:
        deadline.check()
        attempt = place(layout, pool.nodes, keys, used, keep_nodes, count, pack=spec.workload == Workload.TRAINING,
                        warm=warm)
        attempts.append(attempt)
        if len(attempt.replicas) == count:
            chosen = attempt
            break
    shrunk = chosen is None
    if chosen is None:
        chosen = _shrunk(spec, attempts, len(kept), wanted, pool, notes)
    if chosen.layout is not attempts[0].layout and len(attempts[0].replicas) < count:
        notes.append(f"tensor {chosen.layout.tensor} × pipeline {chosen.layout.pipeline} instead of "
                     f"tensor {layouts[0].tensor} × pipeline {layouts[0].pipeline}: {attempts[0].reason}")
    result = _assemble(spec, facts, chosen, kept, wanted, shrunk, notes, by_name, keys, nodes)
    update = {"quantization": quantization, **_concurrency(spec, result.notes)}
    gpus = [by_name[p.node] for p in result.placements]
    if offload and any(n.gpu_memory for n in gpus):
        layout = sharded(spec, facts, chosen.layout, result.replicas)
        budget = offload_budget(spec, facts, layout, gpus)
        if budget < weight_bytes(facts, max(layout.stage_params), layout.tensor):
            # the worker fills what the smallest GPU leaves with resident layers
            update.update(offload_budget=budget, memory_per_gpu=max(
                result.memory_per_gpu, int(min(n.gpu_memory for n in gpus if n.gpu_memory) * USABLE_FRACTION)))
    return result.model_copy(update=update)


def _shrunk(spec: ShardedModelSpec, attempts: list[Attempt], kept: int, wanted: int, pool, notes: list[str]) -> Attempt:
    """The attempt placing most replicas, when the spec allows shrinking (PlanError otherwise), its
    reason added to `notes`."""
    most = max(attempts, key=lambda a: len(a.replicas))  # first among equals: most preferred
    chosen = _whole_sequences(spec, most, kept)
    if not spec.recovery.allow_shrink or (not chosen.replicas and not kept):
        raise PlanError(attempts[0].reason + (f" ({pool.why_not()} left out)" if pool.excluded else ""))
    whole = f" (a multiple of training.contextParallel {spec.context_parallel()})" if chosen is not most else ""
    notes.append(f"shrunk to {kept + len(chosen.replicas)} of {wanted} replica(s){whole}: {attempts[0].reason}")
    return chosen


def _whole_sequences(spec: ShardedModelSpec, attempt: Attempt, kept: int) -> Attempt:
    """A shrunk attempt cut to a multiple of the context-parallel degree (the ranks of a sequence are
    replicas: a part of such a group trains nothing); the attempt itself when it is one."""
    context = spec.context_parallel()
    whole = max(0, (kept + len(attempt.replicas)) // context * context - kept)
    if whole == len(attempt.replicas):
        return attempt
    return dataclasses.replace(attempt, replicas=attempt.replicas[:whole])


def _kept_replicas(keep: Sequence[StagePlacement], wanted: int, by_name: dict[str, NodeInfo],
                   nodes: Sequence[NodeInfo]) -> dict[int, list[StagePlacement]]:
    replicas: dict[int, list[StagePlacement]] = {}
    for p in keep:
        replicas.setdefault(p.replica, []).append(p)
    out: dict[int, list[StagePlacement]] = {}
    shapes = set()
    for r in sorted(replicas)[:wanted]:  # scaling down keeps the lowest replica numbers
        stages = sorted(replicas[r], key=lambda p: p.stage)
        for p in stages:
            if p.node not in by_name:
                known = {n.name for n in nodes}
                state = "is not usable" if p.node in known else "is not in the inventory"
                raise PlanError(f"replica {r} cannot be kept: node {p.node} {state}")
        shapes.add((stages[0].gpus, len(stages)))
        out[r] = stages
    if len(shapes) > 1:
        raise PlanError("kept replicas disagree on tensor and pipeline; re-plan them all")
    return out


def _assemble(spec: ShardedModelSpec, facts: ModelFacts, attempt: Attempt,
              kept: dict[int, list[StagePlacement]], wanted: int, shrunk: bool, notes: list[str],
              by_name: dict[str, NodeInfo], keys: Sequence[str], nodes: Sequence[NodeInfo]) -> ShardPlan:
    layout = sharded(spec, facts, attempt.layout, len(kept) + len(attempt.replicas))
    tree = attempt.tree or Tree([], keys, {}, layout.pipeline)
    free_indices = [r for r in range(wanted + len(kept)) if r not in kept][: len(attempt.replicas)]
    placements: list[StagePlacement] = []
    groups: list[ReplicaPlan] = []
    new = dict(zip(free_indices, attempt.replicas))
    for r in sorted([*kept, *new]):
        if r in kept:
            stage_nodes = [by_name[p.node] for p in kept[r]]
        else:
            stage_nodes = new[r]
        for stage, node in enumerate(stage_nodes):
            start, end = layout.ranges[stage]
            placements.append(StagePlacement(
                replica=r, stage=stage, node=node.name, gpus=layout.tensor, layer_start=start, layer_end=end,
                embedding=stage == 0, head=stage == layout.pipeline - 1, params=layout.stage_params[stage],
                domains={k: node.labels[k] for k in keys if k in node.labels}))
        groups.append(_explain(r, stage_nodes, layout, tree, keys, kept=r in kept))
    why_layout = [_explain_layout(spec, facts, layout, nodes), *_explain_shard(spec, layout, len(groups))]
    return ShardPlan(tensor=layout.tensor, pipeline=layout.pipeline, replicas=len(groups),
                     num_layers=facts.layers, placements=placements, groups=groups,
                     cost=sum(g.cost for g in groups), shrunk=shrunk, notes=[*why_layout, *notes],
                     memory_per_gpu=layout.memory, topology_keys=list(keys), data_shard=layout.shard,
                     context=spec.context_parallel())


def _concurrency(spec: ShardedModelSpec, notes: list[str]) -> dict:
    """A serving plan's max_sequences (step 5), its reason added to `notes`."""
    if spec.workload == Workload.TRAINING:
        return {}
    sequences = spec.serving.planned_sequences()
    notes.append(_explain_concurrency(spec, sequences))
    return {"max_sequences": sequences}


def _explain_concurrency(spec: ShardedModelSpec, sequences: int) -> str:
    serving = spec.serving
    if serving.max_concurrent_requests:
        return f"{sequences} sequences at once per replica (serving.maxConcurrentRequests)"
    if not serving.kv_cache_tokens:
        return (f"{sequences} sequences at once per replica (the default; serving.kvCacheTokens 0 gives each "
                f"a whole context)")
    return (f"{sequences} sequences at once per replica: {serving.kv_cache_tokens} KV-cache tokens / "
            f"{typical_tokens(serving.max_model_length)} "
            f"tokens a sequence, between 1 and {MAX_DERIVED_SEQUENCES} (serving.maxConcurrentRequests overrides)")


def _explain_shard(spec: ShardedModelSpec, layout: Layout, replicas: int) -> list[str]:
    if spec.workload != Workload.TRAINING or replicas == 0:
        return []
    asked = asked_shard(spec)
    how = "asked" if asked == layout.shard else "chosen" if asked is None else f"asked {asked}, shrunk"
    copies = replicas // layout.shard
    out = [f"ZeRO-3 over {layout.shard} replica(s) ({how}) × {copies} replicated: "
           f"{layout.memory / GiB:.1f} GiB per GPU"]
    compression = spec.training.gradient_compression if spec.training else None
    if compression is not None and compression.method != "none" and copies == 1:
        out.append(f"training.gradientCompression {compression.method} has nothing to compress: it acts "
                   f"between replicated copies, and every replica shards (replicate 1)")
    context = spec.context_parallel()
    if context > 1:
        out.append(f"context parallel: each sequence split over {context} replicas ({spec.training.seq_length // context} "
                   f"of its {spec.training.seq_length} tokens each, training.contextParallel); {replicas // context} "
                   f"data-parallel replica(s), ZeRO-3 over dataParallel.shard {layout.shard // context} × {context}")
    if spec.training and spec.training.sequence_parallel:
        out.append(_explain_sequence_parallel(spec.training.seq_length, layout.tensor, context))
    return out


def _explain_sequence_parallel(seq_length: int, tensor: int, context: int = 1) -> str:
    if tensor == 1:
        return "training.sequenceParallel has no effect: the layout has no tensor parallelism (tensor 1)"
    local = seq_length // context     # the tokens of a sequence each context-parallel rank holds
    held = f"seqLength {seq_length}" if context == 1 else f"the {local} tokens of seqLength / contextParallel"
    if local % tensor:
        return (f"training.sequenceParallel cannot split {held} over tensor {tensor}: the "
                f"training pods will refuse to start (make it a multiple of {tensor})")
    return (f"sequence parallel: norms and activations between blocks split over the {tensor} tensor ranks "
            f"({local // tensor} of {local} tokens each)")


def _explain(replica: int, stage_nodes: list[NodeInfo], layout: Layout, tree: Tree,
             keys: Sequence[str], kept: bool) -> ReplicaPlan:
    cost = sum(tree.cost_of(a, b) for a, b in zip(stage_nodes, stage_nodes[1:]))
    # tightest domain holding every stage: a node, then each key from tightest to loosest
    names = sorted({n.name for n in stage_nodes})
    domain = names[0] if len(names) == 1 else ""
    if not domain:
        for key in keys:
            values = {n.labels.get(key) for n in stage_nodes}
            if len(values) == 1 and None not in values:
                domain = f"{key}={values.pop()}"
                break
    crossings = []
    for level, label in [(0, "node")] + [(i + 1, k.rsplit("/", 1)[-1]) for i, k in enumerate(keys)]:
        n = sum(1 for a, b in zip(stage_nodes, stage_nodes[1:]) if tree.cost_of(a, b) > level)
        if n:
            crossings.append(f"{n} {label} boundar{'y' if n == 1 else 'ies'}")
    where = ", ".join(f"{name} ×{sum(1 for n in stage_nodes if n.name == name)}" if
                      sum(1 for n in stage_nodes if n.name == name) > 1 else name
                      for name in dict.fromkeys(n.name for n in stage_nodes))
    text = (f"replica {replica}{' (kept)' if kept else ''}: {layout.pipeline} stage(s) of "
            f"{layout.tensor} GPU(s) on {where}; within {domain or 'the cluster'}; cost {cost}"
            + (f" ({', '.join(crossings)})" if crossings else ""))
    return ReplicaPlan(replica=replica, domain=domain, cost=cost, explanation=text)


def _explain_layout(spec: ShardedModelSpec, facts: ModelFacts, layout: Layout, nodes: Sequence[NodeInfo]) -> str:
    how = lambda asked: "asked" if asked else "chosen"  # noqa: E731
    return (f"tensor {layout.tensor} ({how(spec.parallelism.tensor)}) × pipeline {layout.pipeline} "
            f"({how(spec.parallelism.pipeline)}): {facts.params / 1e9:.2f}B "
            f"parameters at {facts.bytes_per_param:.2f} bytes need {layout.memory / GiB:.1f} GiB per GPU "
            f"({spec.workload.value}); tensor divides {facts.heads} heads and {facts.kv_heads} KV heads"
            + (f" and {facts.experts} experts" if facts.experts else ""))
