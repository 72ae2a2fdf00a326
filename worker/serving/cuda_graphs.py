"""Decode steps replayed as CUDA graphs, on the paged KV cache.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the GPU waits on the launches (a small model's weights stream in about the time the launches
take). A graph records the step's kernels once and replays them with one
launch.

A graph replays fixed shapes and fixed addresses, so:
  * the model runs on the static-shape cache view (cache_view.static_view): each row gathers the
    blocks of its block table over the whole context, masked past its position, with no host
    syncs inside the step;
  * the block tables and positions are inputs of fixed shape: each row's table padded to the most
    blocks a sequence can hold (the context over the block size), so any step's tables replay in
    the same graph, whichever blocks they name. Requests keep paged blocks as in eager decode:
    prefix reuse, preemption and lanes work the same; prefills run eagerly;
  * each step's batch is padded up to a bucket size (powers of two up to the cache's blocks, as
    serving engines do), with one graph per bucket captured on first use. Padding rows, and the
    padding columns of every table, name a scratch block that no request owns (the Stage asks
    setup_caches for one extra block): padding rows write their keys and values there, and
    padding columns are read only at masked positions;
  * inputs are copied into the graph's own input buffers before each replay (one copy for the
    positions and tables together), and its output buffer is reused by the next replay (the
    Stage clones what it keeps);
  * new caches (setup_caches) move the buffers the graphs captured: `reset` drops them.

`step` may be the model itself ("graphs") or a torch.compile of it ("compile": inductor's fused
kernels, captured the same way, so both modes share the padding and the capture). Off CUDA
(`capture=False`) the same static-shape step runs eagerly on the same padded buffers, which is
how it is tested without a GPU; the capture and replay themselves are exercised only on a GPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from shardwise.worker.serving.cache_view import static_view
from shardwise.worker.serving.kv_blocks import blocks_for


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def padded_ints(positions: torch.Tensor, tables: torch.Tensor, n: int, scratch: int, width: int = 0) -> torch.Tensor:
    """int64 [n + n * width] on the host: each row's position, then each row's block table
    (`tables` [b, nb], or [b] for one block per row) padded with the `scratch` block to `width`
    blocks (0: nb), the rows padded to `n` at position 0 of the scratch block."""
    b = positions.shape[0]
    tables = tables.reshape(b, -1) if b else tables.reshape(0, 0)
    width = width or tables.shape[1]
    ints = torch.full((n * (1 + width),), scratch, dtype=torch.int64)
    ints[:n] = 0
    ints[:b] = positions.reshape(-1).cpu()
    ints[n:].view(n, width)[:b, :tables.shape[1]] = tables.cpu()
    return ints


def unpack(ints: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """padded_ints' positions [n, 1] and block tables [n, width], as views."""
    return ints[:n].view(n, 1), ints[n:].view(n, -1)


class GraphedDecode:
    def __init__(self, step: Callable, device: torch.device, capture: bool | None = None):
        self.step, self.device = step, torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.reset(0)

    def reset(self, blocks: int) -> None:
        """Forget the captured graphs (the caches they wrote into are gone); the cache now holds
        `blocks` blocks and the scratch block for padding, block `blocks`."""
        self.scratch = blocks
        self.sizes = buckets(blocks) if blocks else []
        # bucket rows -> (graph or None off CUDA, input x, input ints, output)
        self.graphs: dict[int, tuple] = {}
        # One memory pool shared by the buckets' graphs; a new one with new graphs, since the
        # allocator frees a pool once the graphs that used it are gone.
        self.pool = torch.cuda.graph_pool_handle() if blocks and self.capture else None

    def bucket(self, b: int) -> int:
        return next(n for n in self.sizes if n >= b)

    @property
    def width(self) -> int:
        """Blocks of the longest sequence: every table is padded to it."""
        return blocks_for(self.step.max_seq, self.step.block_size)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Logits (or hidden states on a middle stage) [b, 1, ...] of one decode step at
        `positions` [b, 1] with block tables `tables` [b, nb]; a view of the output buffer."""
        b = x.shape[0]
        n = self.bucket(b)
        if n not in self.graphs:
            self.graphs[n] = self._capture(n, x)
        graph, x_in, ints_in, out = self.graphs[n]
        ints_in.copy_(padded_ints(positions, tables, n, self.scratch, self.width), non_blocking=True)  # one copy
        x_in[:b].copy_(x, non_blocking=True)
        if graph is None:                       # not captured: the same static-shape step, eagerly
            return self.static_step(n, x_in, ints_in)[:b]
        graph.replay()
        return out[:b]

    def static_step(self, n: int, x_in: torch.Tensor, ints_in: torch.Tensor) -> torch.Tensor:
        """The step on the input buffers: fixed shapes, device ops only."""
        positions, tables = unpack(ints_in, n)
        cache = static_view(self.step, positions, tables)
        return self.step(x_in, positions=positions, cache=cache, last_only=True)

    def _capture(self, n: int, like: torch.Tensor):
        x_in = torch.zeros((n, *like.shape[1:]), dtype=like.dtype, device=self.device)
        ints_in = padded_ints(torch.zeros(0, 1), torch.zeros(0, 1), n, self.scratch, self.width).to(self.device)
        if not self.capture:
            return None, x_in, ints_in, None

        def run():
            return self.static_step(n, x_in, ints_in)

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
