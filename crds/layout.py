"""Which ranks a layout has and which layers each pipeline stage holds: one rule for each.

The planner writes both into the ShardPlan and the worker runs by them, so they live here, torch-
free, where the operator image and the worker image both import them. A local `shardwise generate
-p 2` therefore splits a model exactly as a pipeline-2 ShardedModel's pods do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from shardwise.crds.modelshape import ModelFacts


class RankPosition(NamedTuple):
    replica: int
    stage: int
    tp_rank: int       # the GPU index inside the stage's pod


@dataclass(frozen=True)
class RankLayout:
    """Ranks of `replicas` replicas of `pipeline` stages of `tensor` GPUs each:

        rank = (replica * pipeline + stage) * tensor + tp_rank

    A stage's TP group is consecutive ranks (one pod, one node: its all-reduces stay on NVLink).
    An inference replica is a torch.distributed world of its own (replicas=1, replica 0 inside
    it); a training job is one world over all its replicas, which average gradients.
    """

    tensor: int
    pipeline: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if min(self.tensor, self.pipeline, self.replicas) < 1:
            raise ValueError(f"tensor {self.tensor}, pipeline {self.pipeline} and replicas "
                             f"{self.replicas} must each be at least 1")

    @property
    def world_size(self) -> int:
        return self.replicas * self.pipeline * self.tensor

    def rank(self, replica: int, stage: int, tp_rank: int) -> int:
        for name, value, limit in (("replica", replica, self.replicas), ("stage", stage, self.pipeline),
                                   ("tp_rank", tp_rank, self.tensor)):
            if not 0 <= value < limit:
                raise ValueError(f"{name} {value} is outside 0..{limit - 1}")
        return (replica * self.pipeline + stage) * self.tensor + tp_rank

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        group, tp_rank = divmod(rank, self.tensor)
        replica, stage = divmod(group, self.pipeline)
        return RankPosition(replica, stage, tp_rank)

    def stage_ranks(self, stage: int, replica: int = 0) -> list[int]:
        """The ranks of one stage's TP group (one pod)."""
        first = self.rank(replica, stage, 0)
        return list(range(first, first + self.tensor))


class LayerSplit(NamedTuple):
    ranges: tuple[tuple[int, int], ...]   # per stage: [first layer, one past the last)
    params: tuple[int, ...]               # per stage: parameters it holds


def split_layers(facts: ModelFacts, stages: int) -> LayerSplit:
    """Contiguous layer ranges minimising the largest stage's parameters, counting the embedding on
    the first stage and the final norm + LM head on the last (a tied head is a copy there, unless
    the one stage holds both). ValueError when there are more stages than layers."""
    n, per, emb, head = facts.layers, facts.layer_params, facts.embedding_params, facts.head_params
    if not 1 <= stages <= n:
        raise ValueError(f"pipeline {stages} exceeds the model's {n} layers" if stages > n
                         else f"pipeline {stages} must be at least 1")
    if stages == 1:
        shared = facts.embedding_params if facts.tied_embeddings else 0
        return LayerSplit(((0, n),), (emb + n * per + head - shared,))
    extra = [emb] + [0] * (stages - 2) + [head]
    counts = _balanced_counts(n, per, extra)
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return LayerSplit(tuple(ranges), tuple(e + c * per for e, c in zip(extra, counts)))


def _balanced_counts(n: int, per: int, extra: list[int]) -> list[int]:
    """Layers per stage (each at least 1, summing to n) with the smallest largest stage, where
    stage i holds extra[i] + layers * per parameters."""
    stages = len(extra)

    def counts_for(limit: int) -> list[int] | None:
        caps = [(limit - e) // per for e in extra]
        return caps if min(caps) >= 1 and sum(caps) >= n else None

    lo, hi = per, max(extra) + n * per
    while lo < hi:  # smallest largest-stage that fits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if counts_for(mid) else (mid + 1, hi)
    counts = counts_for(lo)
    assert counts is not None
    # Too much room: take layers back from the heaviest stages (later index first on ties).
    return _take_back(counts, sum(counts) - n, per, extra) if sum(counts) > n else counts


def _take_back(counts: list[int], k: int, per: int, extra: list[int]) -> list[int]:
    """`counts` with k layers taken back one at a time from the heaviest stage (extra[i] + counts[i]
    * per, later index first on ties; a stage keeps one), in O(stages x log) rather than O(k x
    stages): each stage's weights fall as it gives layers back, so the k taken are the k heaviest
    (weight, index) of all; `level` is the weight of the last, found by a binary search."""
    def above(w: int) -> int:   # layers whose removal weight is above w
        return sum(max(0, c - max(1, (w - e) // per)) for c, e in zip(counts, extra))
    lo, hi = -1, max(e + c * per for c, e in zip(counts, extra))
    while hi - lo > 1:          # level: the smallest weight with fewer than k layers above it
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if above(mid) < k else (mid, hi)
    level = hi
    out = [min(c, max(1, (level - e) // per)) for c, e in zip(counts, extra)]
    left = k - above(level)     # the rest weigh exactly `level`: later stages first
    for i in reversed(range(len(out))):
        if left and out[i] > 1 and extra[i] + out[i] * per == level:
            out[i] -= 1
            left -= 1
    return out
