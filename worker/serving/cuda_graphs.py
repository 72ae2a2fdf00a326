"""Decode steps replayed as CUDA graphs.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the GPU waits on the launches (a small model's weights stream in about the time the launches
take). A graph records the step's kernels once and replays them with one
launch.

A graph replays fixed shapes and fixed addresses, so:
  * the model runs on the static-shape cache view (cache_view.static_view): attention over the
    whole cache, masked, and no host syncs inside the step;
  * each request's cache is one block of the whole context (the engine keeps fixed rows under
    graphs: a graph cannot replay another step's block tables of another shape);
  * each step's batch is padded up to a bucket size (powers of two up to the cache's rows, as
    serving engines do), with one graph per bucket captured on first use. Padding rows write
    their keys and values into a scratch cache row that no request owns (the Stage asks
    setup_caches for one extra block), so they never touch a request's cache;
  * inputs are copied into the graph's own input buffers before each replay, and its output
    buffer is reused by the next replay (the Stage clones what it keeps);
  * new caches (setup_caches) move the buffers the graphs captured: `reset` drops them.

`step` may be the model itself ("graphs") or a torch.compile of it ("compile": inductor's fused
kernels, captured the same way, so both modes share the padding and the capture).
"""
from __future__ import annotations

from typing import Callable

import torch

from shardwise.worker.serving.cache_view import static_view


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def padded_ints(positions: torch.Tensor, slots: torch.Tensor, n: int, scratch: int) -> torch.Tensor:
    """int64 [2, n] on the host: the step's positions (row 0) and cache rows (row 1: each row's one
    block), padded to `n` rows at position 0 of the `scratch` cache row."""
    b = slots.numel()
    ints = torch.zeros(2, n, dtype=torch.int64)
    ints[0, :b] = positions.reshape(-1).cpu()
    ints[1, :b] = slots.reshape(-1).cpu()
    ints[1, b:] = scratch
    return ints


class GraphedDecode:
    def __init__(self, step: Callable, device: torch.device):
        self.step, self.device = step, device
        self.reset(0)

    def reset(self, max_batch: int) -> None:
        """Forget the captured graphs (the caches they wrote into are gone); the scratch row for
        padding is cache row `max_batch`."""
        self.max_batch = max_batch
        self.sizes = buckets(max_batch) if max_batch else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # One memory pool shared by the buckets' graphs; a new one with new graphs, since the
        # allocator frees a pool once the graphs that used it are gone.
        self.pool = torch.cuda.graph_pool_handle() if max_batch else None

    def bucket(self, b: int) -> int:
        return next(n for n in self.sizes if n >= b)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache_slots: torch.Tensor) -> torch.Tensor:
        """Logits (or hidden states on a middle stage) [b, 1, ...] of one decode step; a view of
        the graph's output buffer."""
        b = x.shape[0]
        n = self.bucket(b)
        if n not in self.graphs:
            self.graphs[n] = self._capture(n, x)
        graph, x_in, ints_in, out = self.graphs[n]
        ints_in.copy_(padded_ints(positions, cache_slots, n, self.max_batch), non_blocking=True)  # one copy
        x_in[:b].copy_(x, non_blocking=True)
        graph.replay()
        return out[:b]

    def _capture(self, n: int, like: torch.Tensor):
        x_in = torch.zeros((n, *like.shape[1:]), dtype=like.dtype, device=self.device)
        ints_in = torch.zeros(2, n, dtype=torch.int64, device=self.device)
        ints_in[1] = self.max_batch

        def run():
            positions = ints_in[0].view(n, 1)
            cache = static_view(self.step, positions, ints_in[1].view(n, 1))
            return self.step(x_in, positions=positions, cache=cache, last_only=True)

        # Warm-up on a side stream, as capture requires: it runs torch.compile's compilation and
        # cuBLAS's workspace set-up, which must not happen inside the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            out = run()
        return graph, x_in, ints_in, out
