"""Placement, for the planner (pure): which nodes' slots each replica's stages take.

A node with F free GPUs offers F // TP slots; one slot holds one stage (one pod), so a TP group
never spans nodes. A replica's cost is the topology boundaries crossed between consecutive stages: 1
per node change, +1 per level of spec.placement.topologyKeys changed. The cheapest slot set is found
exactly by a dynamic programme over the topology tree (Tree: per domain, the best objective for
taking k slots inside it), replica after replica; only the domains a placed replica touched are
recomputed. Ties break towards domains no other replica uses (training: towards those they use),
then towards warm nodes (whose node-local cache holds the model's files: a stage on a cold node
downloads its share first), then towards nodes the replica fills, then by name. Warmth is a
tie-break, never a constraint: it only orders placements equal in boundaries and spread. On small
inventories a branch and bound (_exact) finds the cheapest plan for all replicas together.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from shardwise.operator.planning.inventory import NodeInfo
from shardwise.operator.planning.layouts import GiB, USABLE_FRACTION, Layout, fits

INF = float("inf")


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


class Tree:
    """Topology tree: root > loosest key > ... > tightest key > node, built from label values."""

    def __init__(self, nodes: Sequence[NodeInfo], keys: Sequence[str], slots: dict[str, int], want: int,
                 pack: bool = False, warm: frozenset[str] = frozenset()):
        self.keys = list(keys)                       # tightest first, as in the spec
        self.warm = warm                             # nodes whose cache holds the model's files
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
        # level down (unit**2 and up), then stages on cold nodes (unit**1), then leftover slots on
        # the nodes used (unit**0). Packed into one int: fast to add.
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
        # leftover slots, and on a cold node each stage fetching its share first: unit - 1 more a stage
        step = -1 if leaf.name in self.warm else self.unit - 1
        leaf.best = [0] + [leaf.slots + k * step for k in range(1, k_max + 1)] + [INF] * (self.want - k_max)

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
class Attempt:
    layout: Layout
    replicas: list[list[NodeInfo]] = field(default_factory=list)   # new replicas: one node per stage
    slots: int = 0
    tree: Tree | None = None
    reason: str = ""


def place(layout: Layout, nodes: Sequence[NodeInfo], keys: Sequence[str], used: dict[str, int],
          keep_users: Iterable[list[str]], count: int, pack: bool = False,
          warm: frozenset[str] = frozenset()) -> Attempt:
    """`count` new replicas of `layout` on `nodes`; `warm`: nodes whose cache holds the model (a
    tie-break after boundaries and spread)."""
    attempt = Attempt(layout)
    eligible = [n for n in nodes if fits(layout.memory, n) and n.free - used.get(n.name, 0) >= layout.tensor]
    slots = {n.name: (n.free - used.get(n.name, 0)) // layout.tensor for n in eligible}
    attempt.slots = sum(slots.values())
    if not eligible:
        if count:
            attempt.reason = _no_block_reason(layout, nodes, used)
        return attempt
    tree = Tree(eligible, keys, slots, layout.pipeline, pack, warm)
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


def _chain_cost(tree: Tree, stages: list[NodeInfo]) -> int:
    return sum(tree.cost_of(a, b) for a, b in zip(stages, stages[1:]))


EXACT_MAX_GROUPS = 3000      # candidate slot sets per replica for the exact search
EXACT_MAX_STEPS = 200_000    # search steps before settling for the best plan found


def _exact(tree: Tree, slots: dict[str, int], pipeline: int, count: int, greedy: int) -> list[list[NodeInfo]] | None:
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
            cold = sum(1 for n in stages if n.name not in tree.warm)
            groups.append((_chain_cost(tree, stages), cold, tuple(need.items()), stages))
    groups.sort(key=lambda g: g[:2])    # cheapest first; among equals, the fewest stages on cold nodes
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
            cost, _, need, stages = groups[i]
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
        acts = (f"; {layout.activations / GiB:.1f} GiB of it are training activations (training.seqLength; "
                f"activationCheckpointing or contextParallel cut them)") if layout.activations * 4 > layout.memory else ""
        return (f"needs {layout.memory / GiB:.1f} GiB per GPU at tensor {layout.tensor} × pipeline "
                f"{layout.pipeline}; the largest GPUs have {biggest.gpu_memory / GiB:.0f} GiB "
                f"({biggest.name}, {USABLE_FRACTION:.0%} usable){acts}")
    best = max(roomy, key=lambda n: (n.free - used.get(n.name, 0), n.name))
    return (f"needs {layout.tensor} GPUs in one NVLink domain; the largest free block is "
            f"{best.free - used.get(best.name, 0)} on {best.name}")
