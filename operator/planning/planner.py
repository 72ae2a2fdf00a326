"""The topology-aware sharding planner: spec × model facts × nodes × kept placements -> ShardPlan.

A pure function. The operator calls it on every (re-)plan; `shardwise plan` calls it offline.

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
   towards nodes the replica fills (best fit, keeping big blocks whole), then by name (determinism). Replicas are placed one after the
   other; only the domains a placed replica touched are recomputed, which keeps 1,000 nodes fast.
4. Layers. Split contiguously so stages hold equal parameters, counting the embedding on the
   first stage and the final norm + LM head on the last (crds/layout.py: the worker splits a
   local run the same way).
Weights are sized in the dtype the worker will hold them in on a GPU (crds/modelshape.py
in_memory_dtype: a quantized GGUF is dequantized, so it takes bfloat16's room, not its file's),
or as spec.serving.quantization holds them (ModelFacts.quantized: int8, or gguf - a Q8_0, Q4_0 or
Q4_1 file's layer matrices kept in its blocks, GGUF_NATIVE_BYTES).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from shardwise.crds.layout import split_layers
from shardwise.crds.models import PipelineSchedule, ShardedModelSpec
from shardwise.crds.modelshape import GGUF_NATIVE_BYTES, ModelFacts, ModelFactsError
from shardwise.crds.plan import ReplicaPlan, ShardPlan, StagePlacement
from shardwise.operator.planning.inventory import NodeInfo, usable

GiB = 2**30
CUDA_OVERHEAD = 1 * GiB          # context, cuBLAS workspace, NCCL buffers per GPU
USABLE_FRACTION = 0.90           # of a GPU's memory the planner fills
ACTIVATION_FRACTION = 0.10       # inference activations as a share of the rank's weights
TRAINING_ACTIVATION_FRACTION = 0.25
# ZeRO-3 (FSDP2) with mixed precision, bytes per parameter, sharded over tensor x shard ranks:
MASTER_BYTES = 4                 # fp32 master weights (on float32 the weights themselves)
GRADIENT_BYTES = 4               # fp32 gradients (reduced in fp32)
ADAM_BYTES = 8                   # the two fp32 AdamW moments
BLOCKS_IN_FLIGHT = 2             # unsharded: the block FSDP gathered and the next one, prefetched
INF = float("inf")


class PlanError(ValueError):
    """Nothing fits; str(error) is one sentence saying why. More capacity may fix it."""


class LayoutError(PlanError):
    """The layout asked for cannot hold the model at all, or the spec asks for what this model
    cannot have (quantization gguf of a model not stored as Q8_0, Q4_0 or Q4_1): no amount of
    capacity fixes it."""


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    memory: int                   # bytes per GPU, worst stage
    ranges: tuple[tuple[int, int], ...]
    stage_params: tuple[int, ...]
    shard: int = 1                # training: ZeRO-3 shard degree the memory is sized at


# ------------------------------------------------------------------ layers and memory


def activation_bytes(facts: ModelFacts) -> float:
    """Bytes per KV-cache and activation element: quantized weights still compute in 16 bits."""
    return max(2.0, facts.bytes_per_param) if facts.bytes_per_param <= 4 else 4.0


def weight_bytes(facts: ModelFacts, params: int, tensor: int) -> float:
    """Bytes of weights one GPU of a stage holding `params` parameters keeps, once loaded."""
    return params * facts.bytes_per_param / tensor


def training_state_bytes(facts: ModelFacts, params: int, tensor: int, shard: int, block: int) -> float:
    """Bytes of training state one GPU of a stage holding `params` parameters keeps under ZeRO-3.

    Sharded over its `tensor` ranks and the `shard` data-parallel replicas: fp32 master weights,
    fp32 gradients and both fp32 AdamW moments, 16 bytes a parameter. Unsharded, in the compute
    dtype (bytes_per_param): the blocks in flight - FSDP all-gathers one block (a decoder layer,
    or the embedding or LM head, `block` parameters) while prefetching the next, and frees them
    after use. On float32 the master weights are the weights: no other copy is kept or counted.
    """
    sharded = (MASTER_BYTES + GRADIENT_BYTES + ADAM_BYTES) * params / (tensor * shard)
    gathered = BLOCKS_IN_FLIGHT * block * facts.bytes_per_param / tensor
    return sharded + gathered


def largest_unit(facts: ModelFacts, embedding: bool, head: bool) -> int:
    """Parameters of a stage's largest FSDP unit: a decoder layer, the embedding, the LM head."""
    return max(facts.layer_params, facts.embedding_params if embedding else 0, facts.head_params if head else 0)


def stage_memory(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, params: int, layers: int,
                 shard: int = 1, block: int = 0) -> int:
    """Bytes one GPU of a stage needs: its slice of the weights (training: of the ZeRO-3 state over
    `shard` replicas, `block` the largest unit it gathers) plus headroom."""
    weights = weight_bytes(facts, params, tensor)
    if spec.workload == "training":
        state = training_state_bytes(facts, params, tensor, shard, block or facts.layer_params)
        need = state + TRAINING_ACTIVATION_FRACTION * weights
    else:
        kv = spec.serving.kv_cache_tokens * layers * facts.kv_bytes_per_token_per_layer(activation_bytes(facts))
        if spec.serving.offload:
            # layers beyond two stream through two slots (worker/weights/offload.py): the GPU holds the
            # stage's weights outside its layers and two layers' worth
            weights = min(weights, weight_bytes(facts, params - max(0, layers - 2) * facts.layer_params, tensor))
        need = weights + kv / tensor + ACTIVATION_FRACTION * weights
    return int(need + CUDA_OVERHEAD)


def asked_shard(spec: ShardedModelSpec) -> int | None:
    """The ZeRO-3 shard degree spec.training.dataParallel fixes (shard, or replicas / replicate)."""
    dp = spec.training.data_parallel if spec.workload == "training" and spec.training else None
    replicas = spec.parallelism.replicas
    if dp is None or replicas == 0 or not (dp.shard or dp.replicate):
        return None
    shard = dp.shard or replicas // dp.replicate
    replicate = dp.replicate or replicas // shard
    if shard * replicate != replicas:   # the API refuses it; a spec built in code may not be checked
        raise LayoutError(f"training.dataParallel (shard {dp.shard}, replicate {dp.replicate}) does not "
                          f"split parallelism.replicas {replicas}")
    return shard


def shard_degrees(spec: ShardedModelSpec) -> list[int]:
    """ZeRO-3 shard degrees a layout may be sized at, least sharded first: the spec's, else every
    divisor of the replicas (more sharding, more communication). [1] when not training."""
    replicas = spec.parallelism.replicas
    fixed = asked_shard(spec)
    if fixed or spec.workload != "training" or replicas < 2:
        return [fixed or 1]
    return _divisors(replicas)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _worst_stage(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, ranges: Sequence[tuple[int, int]],
                 params: Sequence[int], shard: int) -> int:
    last = len(ranges) - 1
    return max(stage_memory(facts, spec, tensor, p, e - s, shard, largest_unit(facts, i == 0, i == last))
               for i, (p, (s, e)) in enumerate(zip(params, ranges)))


def make_layout(facts: ModelFacts, spec: ShardedModelSpec, tensor: int, pipeline: int,
                roomy: Callable[[int], bool] | None = None) -> Layout:
    """The layout's layer split and worst-stage memory. Training: at the least-sharded ZeRO-3
    degree whose memory `roomy` accepts (memory falls as the degree grows: a binary search), the
    most sharded when none is, the least when there is no `roomy` to ask."""
    try:
        ranges, params = split_layers(facts, pipeline)
    except ValueError as e:  # more stages than layers: no capacity makes that fit
        raise LayoutError(str(e)) from None
    degrees = shard_degrees(spec)
    lo, hi = 0, len(degrees) - 1 if roomy else 0
    while lo < hi:
        mid = (lo + hi) // 2
        if roomy(_worst_stage(facts, spec, tensor, ranges, params, degrees[mid])):
            hi = mid
        else:
            lo = mid + 1
    memory = _worst_stage(facts, spec, tensor, ranges, params, degrees[lo])
    return Layout(tensor, pipeline, memory, ranges, params, degrees[lo])


def fits(memory: int, node: NodeInfo) -> bool:
    return node.gpu_memory == 0 or memory <= node.gpu_memory * USABLE_FRACTION


def candidate_layouts(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo]) -> list[Layout]:
    """Layouts to try, most preferred first (see the module docstring)."""
    largest_block = max((n.free for n in nodes), default=0)
    memories = [n.gpu_memory for n in nodes if n.gpu_memory] or [0]
    largest_memory = max(memories)

    def fits_some(layout: Layout) -> bool:
        return any(n.free >= layout.tensor and fits(layout.memory, n) for n in nodes)

    def roomy(tensor: int, pipeline: int) -> Callable[[int], bool]:
        """Training's shard degree: enough free GPUs hold `memory` for every replica's stages."""
        need = max(1, spec.parallelism.replicas) * pipeline
        return lambda memory: sum(n.free // tensor for n in nodes if fits(memory, n)) >= need

    if spec.parallelism.tensor:
        tensors = [spec.parallelism.tensor]
    else:
        tensors = [t for t in range(1, max(1, largest_block) + 1) if facts.tensor_fits(t)]
    if spec.parallelism.pipeline:
        return [make_layout(facts, spec, t, spec.parallelism.pipeline, roomy(t, spec.parallelism.pipeline)) for t in tensors]
    single, multi = [], []
    for t in tensors:
        # fewest stages whose worst stage fits the largest GPU (memory falls roughly as 1/stages);
        # ZeRO-3 sharding costs no GPUs, so a training layout shards more before it adds stages
        pp = 1
        while True:
            layout = make_layout(facts, spec, t, pp, roomy(t, pp))
            if largest_memory == 0 or fits_some(layout) or pp >= facts.layers:
                break
            pp += 1
        (single if pp == 1 else multi).append(layout)
    return single + sorted(multi, key=lambda l: (l.pipeline, -l.tensor))


# ------------------------------------------------------------------ topology tree


class _Domain:
    """A node (leaf) or a topology domain; `best[k]` = objective of taking k slots inside it."""

    __slots__ = ("name", "level", "children", "parent", "pos", "slots", "users", "best", "seg", "split", "size", "node")

    def __init__(self, name: str, level: int, parent: "_Domain | None"):
        self.name, self.level, self.parent = name, level, parent
        self.children: list[_Domain] = []
        self.pos = 0            # index among the parent's children
        self.slots = 0          # leaf: free slots; inner: sum of children's
        self.users = 0          # replicas of this model already using the domain
        self.best: list[float] = []
        # Segment tree over the children: seg[i] = min-plus convolution of the children's entry
        # tables below i, split[i][k] = slots taken from the left half. One child changing costs
        # log(children) convolutions, so placing a replica stays cheap however wide a domain is.
        self.seg: list[list[float]] = []
        self.split: list[list[int]] = []
        self.size = 0
        self.node: NodeInfo | None = None


def _convolve(a: list[float], b: list[float], want: int) -> tuple[list[float], list[int]]:
    out = [INF] * (want + 1)
    split = [0] * (want + 1)
    for i in range(want, -1, -1):  # on ties, more from the left: earlier names win
        x = a[i]
        if x == INF:
            continue
        for j in range(want + 1 - i):
            y = b[j]
            if y == INF:
                continue
            if x + y < out[i + j]:
                out[i + j], split[i + j] = x + y, i
    return out, split


class _Tree:
    """Topology tree: root > loosest key > ... > tightest key > node, built from label values."""

    def __init__(self, nodes: Sequence[NodeInfo], keys: Sequence[str], slots: dict[str, int], want: int,
                 pack: bool = False):
        self.keys = list(keys)                       # tightest first, as in the spec
        self.overlap = -1 if pack else 1             # other replicas in a domain: attract, or repel
        self.depth = len(self.keys)                  # levels of domains below the root
        self.want = want
        self.root = _Domain("", -1, None)
        self.leaves: dict[str, _Domain] = {}
        index: dict[tuple[str, ...], _Domain] = {(): self.root}
        for node in sorted(nodes, key=lambda n: (self.path(n), n.name)):
            path = self.path(node)
            parent = self.root
            for level in range(self.depth):
                key = path[: level + 1]
                if key not in index:
                    index[key] = _Domain(path[level], level, parent)
                    index[key].pos = len(parent.children)
                    parent.children.append(index[key])
                parent = index[key]
            leaf = _Domain(node.name, self.depth, parent)
            leaf.node, leaf.slots, leaf.pos = node, slots[node.name], len(parent.children)
            parent.children.append(leaf)
            self.leaves[node.name] = leaf
        # Objective weights: boundaries first, then overlap with other replicas from the loosest
        # level down, then leftover slots on the nodes used. Packed into one int: fast to add.
        self.unit = 1 << 20
        self.weight_cost = self.unit ** (self.depth + 3)
        self.empty = [0] + [INF] * want

    def path(self, node: NodeInfo) -> tuple[str, ...]:
        """Label values loosest first; a missing label makes the node a domain of its own."""
        return tuple(node.labels.get(k) or f"~{node.name}" for k in reversed(self.keys))

    def crossing(self, domain: _Domain) -> int:
        """Boundaries crossed between two children of `domain` (node change counts 1, each level 1 more)."""
        return self.depth - domain.level

    def mark_used(self, names: Iterable[str]) -> None:
        """Count one more replica in every domain holding one of these nodes."""
        seen: set[int] = set()
        for name in names:
            domain = self.leaves.get(name)
            while domain is not None and domain is not self.root:
                if id(domain) not in seen:
                    seen.add(id(domain))
                    domain.users += 1
                domain = domain.parent

    def build(self) -> None:
        for domain in _post_order(self.root):
            if not domain.children:
                self._leaf_best(domain)
                continue
            domain.size = 1
            while domain.size < len(domain.children):
                domain.size *= 2
            domain.seg = [self.empty] * (2 * domain.size)
            domain.split = [[]] * (2 * domain.size)
            for child in domain.children:
                domain.seg[domain.size + child.pos] = self._entry(domain, child)
            for i in range(domain.size - 1, 0, -1):
                domain.seg[i], domain.split[i] = _convolve(domain.seg[2 * i], domain.seg[2 * i + 1], self.want)
            self._inner_best(domain)

    def _entry(self, domain: _Domain, child: _Domain) -> list[float]:
        """child.best plus the price of entering the child: one more boundary, overlap with others."""
        enter = (self.crossing(domain) * self.weight_cost
                 + self.overlap * child.users * self.unit ** (self.depth + 1 - domain.level))
        return [0] + [b + enter if b != INF else INF for b in child.best[1:]]

    def _leaf_best(self, leaf: _Domain) -> None:
        k_max = min(leaf.slots, self.want)
        leaf.best = [0] + [leaf.slots - k for k in range(1, k_max + 1)] + [INF] * (self.want - k_max)

    def _inner_best(self, domain: _Domain) -> None:
        cross = self.crossing(domain) * self.weight_cost
        top = domain.seg[1]
        domain.best = [0] + [v - cross if v != INF else INF for v in top[1:]]
        domain.slots = sum(c.slots for c in domain.children)

    def _update(self, domain: _Domain, child: _Domain) -> None:
        i = domain.size + child.pos
        domain.seg[i] = self._entry(domain, child)
        i //= 2
        while i >= 1:
            domain.seg[i], domain.split[i] = _convolve(domain.seg[2 * i], domain.seg[2 * i + 1], self.want)
            i //= 2

    def take(self, domain: _Domain, k: int) -> list[tuple[_Domain, int]]:
        """Reconstruct: (leaf, slots) pairs realising domain.best[k]."""
        if not domain.children:
            return [(domain, k)]
        out: list[tuple[_Domain, int]] = []
        stack = [(1, k)]
        while stack:
            i, k = stack.pop()
            if k == 0:
                continue
            if i >= domain.size:
                out += self.take(domain.children[i - domain.size], k)
            else:
                left = domain.split[i][k]
                stack += [(2 * i + 1, k - left), (2 * i, left)]
        return out

    def commit(self, taken: list[tuple[_Domain, int]]) -> None:
        """Use the slots; mark each touched domain used once; recompute only touched paths."""
        touched: dict[int, _Domain] = {}
        for leaf, t in taken:
            leaf.slots -= t
            domain = leaf
            while domain is not None:
                touched[id(domain)] = domain
                domain = domain.parent
        for domain in touched.values():
            if domain is not self.root:
                domain.users += 1
        for domain in sorted(touched.values(), key=lambda d: -d.level):
            if domain.children:
                self._inner_best(domain)
            else:
                self._leaf_best(domain)
            if domain.parent is not None:
                self._update(domain.parent, domain)

    def cost_of(self, a: NodeInfo, b: NodeInfo) -> int:
        if a.name == b.name:
            return 0
        pa, pb = self.path(a), self.path(b)
        common = 0
        while common < self.depth and pa[common] == pb[common]:
            common += 1
        return 1 + self.depth - common


# ------------------------------------------------------------------ the planner


@dataclass
class _Attempt:
    layout: Layout
    replicas: list[list[NodeInfo]] = field(default_factory=list)   # new replicas: one node per stage
    slots: int = 0
    tree: _Tree | None = None
    reason: str = ""


def _place(layout: Layout, nodes: Sequence[NodeInfo], keys: Sequence[str], used: dict[str, int],
           keep_users: Iterable[list[str]], count: int, pack: bool = False) -> _Attempt:
    attempt = _Attempt(layout)
    eligible = [n for n in nodes if fits(layout.memory, n) and n.free - used.get(n.name, 0) >= layout.tensor]
    slots = {n.name: (n.free - used.get(n.name, 0)) // layout.tensor for n in eligible}
    attempt.slots = sum(slots.values())
    if not eligible:
        if count:
            attempt.reason = _no_block_reason(layout, nodes, used)
        return attempt
    tree = _Tree(eligible, keys, slots, layout.pipeline, pack)
    attempt.tree = tree
    for kept in keep_users:  # kept replicas count as users: new ones spread away from them (or pack)
        tree.mark_used(kept)
    tree.build()
    for _ in range(count):
        if tree.root.best[layout.pipeline] == INF:
            break
        taken = tree.take(tree.root, layout.pipeline)
        tree.commit(taken)
        stages: list[NodeInfo] = []
        for leaf, t in sorted(taken, key=lambda lt: (tree.path(lt[0].node), lt[0].name)):
            stages += [leaf.node] * t
        attempt.replicas.append(stages)
    if len(attempt.replicas) == count > 1:
        better = _exact(tree, slots, layout.pipeline, count, sum(_chain_cost(tree, r) for r in attempt.replicas))
        if better is not None:
            attempt.replicas = better
    if len(attempt.replicas) < count:
        attempt.reason = (f"needs {count} replica(s) × {layout.pipeline} stage(s) of {layout.tensor} GPU(s) "
                          f"on one node each; only {attempt.slots} such block(s) are free")
    return attempt


def _chain_cost(tree: _Tree, stages: list[NodeInfo]) -> int:
    return sum(tree.cost_of(a, b) for a, b in zip(stages, stages[1:]))


EXACT_MAX_GROUPS = 3000      # candidate slot sets per replica for the exact search
EXACT_MAX_STEPS = 200_000    # search steps before settling for the best plan found


def _exact(tree: _Tree, slots: dict[str, int], pipeline: int, count: int, greedy: int) -> list[list[NodeInfo]] | None:
    """A cheaper plan than the replica-by-replica one, by branch and bound, or None.

    Placing replicas one at a time is optimal for each replica but not always for all together
    (taking the only two-slot node for one replica can force the next across a zone). On small
    inventories the optimum is found exactly; the bound is the cheapest slot set still free.
    """
    leaves = sorted((leaf for leaf in tree.leaves.values() if slots[leaf.name]),
                    key=lambda leaf: (tree.path(leaf.node), leaf.name))
    if not leaves or math.comb(len(leaves) + pipeline - 1, pipeline) > EXACT_MAX_GROUPS:
        return None
    groups = []
    for combo in itertools.combinations_with_replacement(range(len(leaves)), pipeline):
        need = Counter(combo)
        if all(n <= slots[leaves[i].name] for i, n in need.items()):
            stages = [leaves[i].node for i in combo]  # leaves are in path order: the cheapest chain
            groups.append((_chain_cost(tree, stages), tuple(need.items()), stages))
    groups.sort(key=lambda g: g[0])
    if not groups or greedy <= count * groups[0][0]:
        return None  # nothing can beat it: every replica already costs the least any could
    free = [slots[leaf.name] for leaf in leaves]
    best_cost, best, chosen, steps = greedy, None, [], 0

    def search(start: int, left: int, total: int) -> None:
        nonlocal best_cost, best, steps
        if left == 0:
            best_cost, best = total, list(chosen)
            return
        for i in range(start, len(groups)):  # replicas are alike: take slot sets in list order
            steps += 1
            cost, need, stages = groups[i]
            if total + cost * left >= best_cost or steps > EXACT_MAX_STEPS:
                return  # sorted by cost: no later set can do better
            if all(free[j] >= n for j, n in need):
                for j, n in need:
                    free[j] -= n
                chosen.append(stages)
                search(i, left - 1, total + cost)
                chosen.pop()
                for j, n in need:
                    free[j] += n

    search(0, count, 0)
    return best


def _post_order(domain: _Domain) -> list[_Domain]:
    out: list[_Domain] = []
    for child in domain.children:
        out += _post_order(child)
    out.append(domain)
    return out


def _no_block_reason(layout: Layout, nodes: Sequence[NodeInfo], used: dict[str, int]) -> str:
    if not nodes:
        return "no node has free GPUs"
    roomy = [n for n in nodes if fits(layout.memory, n)]
    if not roomy:
        biggest = max(nodes, key=lambda n: (n.gpu_memory, n.name))
        return (f"needs {layout.memory / GiB:.1f} GiB per GPU at tensor {layout.tensor} × pipeline "
                f"{layout.pipeline}; the largest GPUs have {biggest.gpu_memory / GiB:.0f} GiB "
                f"({biggest.name}, {USABLE_FRACTION:.0%} usable)")
    best = max(roomy, key=lambda n: (n.free - used.get(n.name, 0), n.name))
    return (f"needs {layout.tensor} GPUs in one NVLink domain; the largest free block is "
            f"{best.free - used.get(best.name, 0)} on {best.name}")


def plan(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo],
         keep: Sequence[StagePlacement] = ()) -> ShardPlan:
    """The plan for `spec`, or PlanError with a one-sentence reason.

    `nodes` is the inventory with GPUs of other workloads already subtracted and this model's own
    pods *not* subtracted; `keep` are placements of this model's replicas that must stay where
    they are (the operator re-plans one replica at a time). Their GPUs are subtracted here.

    Inference may hold the weights quantized (spec.serving.quantization: a GGUF's own blocks or
    INT8) and stream layers from host memory (spec.serving.offload). They are tried in `variants`
    order, the first plan that places every replica taken, else the one placing most; a plan that
    is not the first variant's says in its first note what it changed and why. A quantization the
    model cannot have (gguf of a model not stored as Q8_0, Q4_0 or Q4_1) is a LayoutError.
    """
    tried: list[tuple[str, bool, ShardPlan | None, str]] = []
    for quantization, offload in variants(spec, facts):
        try:
            sized = facts.quantized(quantization)
        except ModelFactsError as e:   # gguf asked of a model not stored in such blocks: name the field
            raise LayoutError(f"serving.{e}") from None
        try:
            result = _plan(spec, sized, nodes, keep, quantization, offload)
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
    if spec.workload == "training":
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


def offload_budget(spec: ShardedModelSpec, facts: ModelFacts, layout: Layout, gpus: Sequence[NodeInfo]) -> int:
    """Bytes of weights each GPU of a streaming plan may keep resident: what the smallest GPU placed
    on leaves after the worst stage's KV cache, the CUDA overhead and activations (stage_memory's
    terms, solved for the weights)."""
    usable = min(n.gpu_memory for n in gpus if n.gpu_memory) * USABLE_FRACTION
    layers = max(e - s for s, e in layout.ranges)
    kv = spec.serving.kv_cache_tokens * layers * facts.kv_bytes_per_token_per_layer(activation_bytes(facts))
    return max(0, int((usable - kv / layout.tensor - CUDA_OVERHEAD) / (1 + ACTIVATION_FRACTION)))


def _plan(spec: ShardedModelSpec, facts: ModelFacts, nodes: Sequence[NodeInfo],
          keep: Sequence[StagePlacement], quantization: str, offload: bool) -> ShardPlan:
    """The plan with the weights sized as `facts` says, streaming layers when `offload`."""
    if spec.workload != "training" and spec.serving.offload != offload:
        spec = spec.model_copy(update={"serving": spec.serving.model_copy(update={"offload": offload})})
    _check_layout(spec, facts)
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

    layouts = _layouts(spec, facts, pool, kept, wanted)
    unknown = sum(1 for n in pool.nodes if not n.gpu_memory)
    if unknown:
        notes.append(f"GPU memory unknown on {unknown} node(s) (no nvidia.com/gpu.memory label; set "
                     f"spec.gpu.minMemory): assumed large enough")
    keys = spec.placement.topology_keys
    keep_nodes = [[p.node for p in stages] for stages in kept.values()]

    attempts: list[_Attempt] = []
    chosen: _Attempt | None = None
    for layout in layouts:
        attempt = _place(layout, pool.nodes, keys, used, keep_nodes, count, pack=spec.workload == "training")
        attempts.append(attempt)
        if len(attempt.replicas) == count:
            chosen = attempt
            break
    shrunk = False
    if chosen is None:
        most = max(attempts, key=lambda a: len(a.replicas))  # first among equals: most preferred
        if not spec.recovery.allow_shrink or (not most.replicas and not kept):
            raise PlanError(attempts[0].reason + (f" ({pool.why_not()} left out)" if pool.excluded else ""))
        chosen, shrunk = most, True
        notes.append(f"shrunk to {len(kept) + len(most.replicas)} of {wanted} replica(s): {attempts[0].reason}")
    if chosen is not attempts[0] and len(attempts[0].replicas) < count:
        notes.append(f"tensor {chosen.layout.tensor} × pipeline {chosen.layout.pipeline} instead of "
                     f"tensor {layouts[0].tensor} × pipeline {layouts[0].pipeline}: {attempts[0].reason}")
    result = _assemble(spec, facts, chosen, kept, wanted, shrunk, notes, by_name, keys, nodes)
    update = {"quantization": quantization}
    gpus = [by_name[p.node] for p in result.placements]
    if offload and any(n.gpu_memory for n in gpus):
        layout = _sharded(spec, facts, chosen.layout, result.replicas)
        budget = offload_budget(spec, facts, layout, gpus)
        if budget < weight_bytes(facts, max(layout.stage_params), layout.tensor):
            # the worker fills what the smallest GPU leaves with resident layers
            update.update(offload_budget=budget, memory_per_gpu=max(
                result.memory_per_gpu, int(min(n.gpu_memory for n in gpus if n.gpu_memory) * USABLE_FRACTION)))
    return result.model_copy(update=update)


def _check_layout(spec: ShardedModelSpec, facts: ModelFacts) -> None:
    """The degrees the spec names must fit the model's heads and layers, whatever the capacity:
    one line naming the spec's field and what would work."""
    if spec.parallelism.expert and not facts.experts:
        raise LayoutError(f"parallelism.expert {spec.parallelism.expert} is for mixture-of-experts models; "
                          f"this model has no experts (use parallelism.tensor)")
    if spec.parallelism.tensor:
        for name, count in (("attention heads", facts.heads), ("KV heads", facts.kv_heads),
                            ("experts (expert parallel splits them over the tensor group)", facts.experts),
                            ("shared expert width (intermediate size, split like a dense MLP)", facts.shared_intermediate)):
            if count and count % spec.parallelism.tensor:
                fitting = ", ".join(map(str, _divisors(math.gcd(facts.heads, facts.kv_heads, facts.experts,
                                                                facts.shared_intermediate))))
                raise LayoutError(f"parallelism.tensor {spec.parallelism.tensor} does not divide the model's "
                                  f"{count} {name}; use one of {fitting}")
    if spec.parallelism.pipeline and spec.parallelism.pipeline > facts.layers:
        raise LayoutError(f"parallelism.pipeline {spec.parallelism.pipeline} exceeds the model's "
                          f"{facts.layers} layers; use 1 to {facts.layers}")
    asked_shard(spec)   # a dataParallel that does not split the replicas (a spec the API did not check)


INTERLEAVED_VIRTUAL_STAGES = 2   # stages each pipeline rank holds under Interleaved1F1B (worker/training/schedules.py)


def _fit_schedule(spec: ShardedModelSpec, facts: ModelFacts, layouts: list[Layout]) -> list[Layout]:
    """Interleaved1F1B cuts the model into 2 stages per pipeline rank, so 2 x pipeline <= layers,
    and runs a multiple of the pipeline degree as micro-batches (training.microBatches, when
    given): only such layouts (pipeline 1 runs as 1F1B)."""
    t = spec.training if spec.workload == "training" else None
    if t is None or t.schedule != PipelineSchedule.INTERLEAVED_1F1B or not layouts:
        return layouts
    fitting = [layout for layout in layouts if layout.pipeline == 1 or (
        INTERLEAVED_VIRTUAL_STAGES * layout.pipeline <= facts.layers
        and (not t.micro_batches or t.micro_batches % layout.pipeline == 0))]
    p = layouts[0].pipeline
    if not fitting and INTERLEAVED_VIRTUAL_STAGES * p > facts.layers:
        raise LayoutError(f"training.schedule Interleaved1F1B needs {INTERLEAVED_VIRTUAL_STAGES * p} stages for "
                          f"{p} pipeline ranks, more than the model's {facts.layers} layers; use 1F1B or GPipe")
    if not fitting:
        raise LayoutError(f"training.microBatches {t.micro_batches} is not a multiple of the {p} pipeline stages "
                          f"the model needs; schedule Interleaved1F1B needs that: set microBatches to a "
                          f"multiple of {p}, or parallelism.pipeline")
    return fitting


def _layouts(spec: ShardedModelSpec, facts: ModelFacts, pool, kept: dict[int, list[StagePlacement]],
             wanted: int) -> list[Layout]:
    """The layouts to try, most preferred first: the kept replicas' own, else the candidates."""
    if kept:
        first = next(iter(kept.values()))
        return [make_layout(facts, spec, first[0].gpus, len(first))]
    if wanted == 0 and not pool.nodes:
        return [make_layout(facts, spec, spec.parallelism.tensor or 1, spec.parallelism.pipeline or 1)]
    if not pool.nodes:
        raise PlanError(f"no node can run it ({pool.why_not()})" if pool.excluded else "the inventory has no nodes")
    layouts = candidate_layouts(spec, facts, pool.nodes)
    if not layouts:
        raise LayoutError(f"no tensor degree up to the largest free block of "
                          f"{max(n.free for n in pool.nodes)} GPUs divides the model's "
                          f"{facts.heads} attention and {facts.kv_heads} KV heads"
                          + (f" and {facts.experts} experts" if facts.experts else ""))
    return _fit_schedule(spec, facts, layouts)


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


def _assemble(spec: ShardedModelSpec, facts: ModelFacts, attempt: _Attempt,
              kept: dict[int, list[StagePlacement]], wanted: int, shrunk: bool, notes: list[str],
              by_name: dict[str, NodeInfo], keys: Sequence[str], nodes: Sequence[NodeInfo]) -> ShardPlan:
    layout = _sharded(spec, facts, attempt.layout, len(kept) + len(attempt.replicas))
    tree = attempt.tree or _Tree([], keys, {}, layout.pipeline)
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
                     memory_per_gpu=layout.memory, topology_keys=list(keys), data_shard=layout.shard)


def _sharded(spec: ShardedModelSpec, facts: ModelFacts, layout: Layout, replicas: int) -> Layout:
    """The layout at a shard degree dividing the replicas planned: a plan shrunk to replicas its
    degree does not divide takes the least-sharded divisor at least as sharded, else all of them."""
    if replicas % layout.shard == 0:   # always so for serving (shard 1) and for a plan not shrunk
        return layout
    shard = next((d for d in _divisors(replicas) if d >= layout.shard), replicas)
    memory = _worst_stage(facts, spec, layout.tensor, layout.ranges, layout.stage_params, shard)
    return dataclasses.replace(layout, shard=shard, memory=memory)


def _explain_shard(spec: ShardedModelSpec, layout: Layout, replicas: int) -> list[str]:
    if spec.workload != "training" or replicas == 0:
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
    return out


def _explain(replica: int, stage_nodes: list[NodeInfo], layout: Layout, tree: _Tree,
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
            f"({spec.workload}); tensor divides {facts.heads} heads and {facts.kv_heads} KV heads"
            + (f" and {facts.experts} experts" if facts.experts else ""))
