"""Pipeline parallelism: stages own contiguous layer ranges and pass hidden states with send/recv.

Ranks: crds/layout.py RankLayout (a replica is its own world). Rank 0 (stage 0, TP rank 0) drives:
it decides every step (which requests, which tokens, positions, cache blocks), runs stage 0 and
sends the step down the pipeline; the last stage returns the logits rank 0 asked for.

A step is R rows of N tokens in all, row r feeding counts[r] of them (a decode token, a prompt
chunk, a token and its draft) and asking for the logits of its last logits[r] positions (0, 1, or
more to verify a draft). Every message between consecutive stages is
    header  int64[4]  STEP: (op, rows R, tokens N, blocks per row NB)
                      SETUP: (op, cache blocks, context length, block size)
    ints    int64[2R + N + R*NB]  counts, logits, positions (row by row), each row's block table
    hidden  [N, H] in the model dtype                        (op == STEP only)
and the last stage sends rank 0 the logits [sum(logits), V] (float32; nothing when none is asked).
Rows that all feed the same number of tokens run as a dense batch [R, T] (a decode step: the
fast decode path, CUDA graphs or the compiled one); rows of different lengths run flattened into
one row of N tokens, each attending to its own cached positions (cache_view.ragged_view).
TP rank r of stage s talks to TP rank r of stage s+1 (after the row-parallel all-reduce,
hidden states are identical on every TP rank of a stage). The TP peers of rank 0 get the step by
a broadcast inside stage 0's TP group.

Several steps are in flight at once: `launch` returns as soon as stage 0 has sent its part, so
rank 0 can start the next micro-batch while later stages work on the previous one (scheduler.py
keeps one micro-batch per stage in flight).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from shardwise.crds.layout import RankLayout

from shardwise.worker.serving.cache_view import cache_view, ragged_view
from shardwise.worker.serving.cuda_graphs import GraphedDecode
from shardwise.worker.serving.fastpath import compile_decode
from shardwise.worker.errors import WorkerError
from shardwise.worker.distributed.tensor_parallel import COMM

OP_STEP, OP_SETUP, OP_STOP = 1, 2, 3

DECODE_MODES = ("auto", "eager", "graphs", "compile")


def decode_mode(requested: str, device_type: str, tensor: int, streamed: bool = False,
                experts: bool = False) -> str:
    """How a stage runs its decode steps (one new token per row):
      eager    each op launched from Python;
      graphs   CUDA only: each step replayed as a CUDA graph (cuda_graphs.py);
      compile  torch.compile: on CUDA inductor's kernels replayed as a CUDA graph, on CPU
               inductor's C++ (fastpath.compile_decode);
      auto     graphs on CUDA, eager on CPU.
    Tensor-parallel CUDA stages stay eager: their all-reduces sit inside the step. So do stages
    that stream layers from host memory (`streamed`, offload.py): a graph would replay one step's
    copies and slot bindings, not the next one's. And so do mixture-of-experts stages (`experts`,
    moe.py): which tokens each expert runs is decided on the host every step, a data-dependent
    shape no graph can replay."""
    if requested not in DECODE_MODES:
        raise WorkerError(f"unknown decode mode {requested!r} (use one of: {', '.join(DECODE_MODES)})")
    if requested == "graphs" and device_type != "cuda":
        raise WorkerError("--decode graphs needs --device cuda (CUDA graphs); on CPU use eager or compile")
    if streamed and requested in ("graphs", "compile"):
        raise WorkerError(f"--decode {requested} cannot run layers streamed from host memory "
                          f"(--offload-budget); use --decode eager or auto")
    if experts and requested in ("graphs", "compile"):
        raise WorkerError(f"--decode {requested} cannot run a mixture-of-experts model (its tokens "
                          f"are routed to experts on the host each step); use --decode eager or auto")
    if streamed or experts:
        return "eager"
    if requested == "auto":
        requested = "graphs" if device_type == "cuda" else "eager"
    if device_type == "cuda" and tensor > 1:
        return "eager"
    return requested


@dataclass
class StageInfo:
    rank: int
    world: int
    tensor: int
    pipeline: int
    stage: int
    tp_rank: int
    tp_group: object = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pipeline - 1

    # Cached: the pipeline asks for its peers on every step.
    @cached_property
    def layout(self) -> RankLayout:
        return RankLayout(self.tensor, self.pipeline)

    @cached_property
    def next_rank(self) -> int:
        return self.layout.rank(0, self.stage + 1, self.tp_rank)

    @cached_property
    def prev_rank(self) -> int:
        return self.layout.rank(0, self.stage - 1, self.tp_rank)

    @cached_property
    def last_stage_rank0(self) -> int:
        return self.layout.rank(0, self.pipeline - 1, 0)


def _recv(t: torch.Tensor, src: int) -> torch.Tensor:
    t0 = time.perf_counter()
    dist.recv(t, src)
    COMM.add(t0, t)
    return t


class _Sender:
    """Non-blocking sends whose buffers stay alive until they complete."""

    def __init__(self):
        self.works: deque = deque()

    def send(self, tensors, dst: int) -> None:
        t0 = time.perf_counter()
        for t in tensors:
            t = t.contiguous()
            self.works.append((dist.isend(t, dst), t))
        COMM.add(t0, tensors[-1])
        while len(self.works) > 32:   # bound the memory held by sends the peer has not taken yet
            self.wait_one()

    def wait_one(self) -> None:
        work, _ = self.works.popleft()
        work.wait()

    def flush(self) -> None:
        while self.works:
            self.wait_one()


class Stage:
    """One rank's part of the pipeline: its model stage and the messages around it."""

    def __init__(self, model, info: StageInfo, device, decode: str = "auto"):
        self.model, self.info, self.device = model, info, torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self.sender = _Sender()
        self.pending: deque = deque()        # rank 0: launched steps whose logits are not back yet
        # gloo moves CPU tensors, NCCL device tensors.
        self.comm_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.decode = decode_mode(decode, self.device.type, info.tensor, model.before_layer is not None,
                                  model.config.num_experts > 0)
        self.graphed: GraphedDecode | None = None
        if self.decode in ("graphs", "compile") and self.device.type == "cuda":
            # Decode is launch-bound on a GPU: replay each step as a CUDA graph (cuda_graphs.py).
            step = torch.compile(model, dynamic=False) if self.decode == "compile" else model
            self.graphed = GraphedDecode(step, self.device)
        elif self.decode == "compile":
            # On CPU a compiled decode step is ~1.25x faster (docs/worker.md, Benchmark), but each
            # kind of step (one row or several, masked or not) compiles for 10-60 s on first use,
            # which a short `shardwise generate` or a test would never win back: opt-in.
            compile_decode(model)

    def _c(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.comm_device)

    # ---- shared by all ranks -------------------------------------------------------------
    def _compute(self, op: int, r: int, n: int, ints: torch.Tensor | None, x: torch.Tensor | None, nb: int = 0):
        """SETUP (r cache blocks of nb positions for contexts of n) or one step of r rows and n
        tokens (`x`: token ids [N] or hidden states [N, H]) described by `ints` (module docstring).
        Returns the logits asked for [K, V] (float32) on the last stage, hidden states [N, H] else."""
        if op == OP_SETUP:
            # With graphs, one more block: the scratch row the padding rows write to.
            self.model.setup_caches(r + (self.graphed is not None), n, nb, device=self.device)
            if self.graphed is not None:
                self.graphed.reset(r)
            return None
        head = ints[:2 * r].tolist()
        counts, logits = head[:r], head[r:]
        positions = ints[2 * r:2 * r + n].to(self.device)
        blocks = ints[2 * r + n:].view(r, nb).to(self.device)
        with torch.no_grad():
            if all(c == counts[0] for c in counts):
                out = self._dense(x.view(r, counts[0], *x.shape[1:]), positions.view(r, -1), blocks, logits)
            else:
                out = self._ragged(x.view(1, n, *x.shape[1:]), counts, positions, blocks, logits)
        return out.reshape(n, -1) if not self.info.is_last else out

    def _dense(self, x, positions, blocks, logits: list[int]) -> torch.Tensor:
        """Rows of T tokens each [R, T]: a decode step (T = 1; graphed when graphs are on) or
        one prompt chunk, as a batch."""
        x = x.to(self.device)
        every_last = all(k == 1 for k in logits)
        if x.shape[1] == 1 and self.graphed is not None:
            out = self.graphed(x, positions, blocks).clone()   # the graph reuses its output buffer
            if not self.info.is_last:
                return out
            # the graph's logits [R, 1, V]; a row of a prompt's middle (1 token, 0 logits) is dropped
            out = out[:, -1].float()
            return out if every_last else out[[i for i, k in enumerate(logits) if k]]
        cache = cache_view(self.model, positions, blocks)     # prefills and drafts: eager, paged
        out = self.model(x, positions=positions, cache=cache, last_only=every_last, return_hidden=not every_last)
        if not self.info.is_last:
            return out
        if every_last:
            return out[:, -1].float()
        t = x.shape[1]
        return self._head(out.reshape(-1, out.shape[-1]), [t] * len(logits), logits)

    def _ragged(self, x, counts: list[int], positions, blocks, logits: list[int]) -> torch.Tensor:
        """Rows of different lengths, flattened into one row [1, N] (cache_view.ragged_view)."""
        cache = ragged_view(self.model, counts, positions, blocks)
        out = self.model(x.to(self.device), positions=positions[None], cache=cache, return_hidden=True)
        return self._head(out[0], counts, logits) if self.info.is_last else out

    def _head(self, hidden: torch.Tensor, counts: list[int], logits: list[int]) -> torch.Tensor:
        """The LM head over each row's last logits[r] positions of the normed `hidden` [N, H]."""
        keep, at = [], 0
        for c, k in zip(counts, logits):
            keep.extend(range(at + c - k, at + c))
            at += c
        if not keep:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=hidden.device)
        rows = hidden.index_select(0, torch.tensor(keep, device=hidden.device))
        return self.model.output(rows).float()

    def _forward_next(self, header, ints, out) -> None:
        msgs = [header, ints] + ([out] if out is not None else [])
        self.sender.send(msgs, self.info.next_rank)

    # ---- rank 0 -----------------------------------------------------------------------------
    def launch(self, op: int, tokens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               blocks: torch.Tensor | None = None, cache_blocks: int = 0, seq: int = 0,
               block_size: int = 0, counts: list[int] | None = None, logits: list[int] | None = None) -> None:
        """Run one step (or a SETUP/STOP) on stage 0 and send it on; results come from `collect`.
        STEP: tokens and positions [B, T] with block tables [B, NB], each row's last-position
        logits asked for; or a ragged step: tokens and positions [N] row by row, row r feeding
        `counts[r]` of them and asking for the logits of its last `logits[r]` (default 1 each).
        SETUP: a cache of `cache_blocks` blocks of `block_size` positions (0: one context, `seq`,
        each) for contexts of `seq`."""
        info = self.info
        if op == OP_STEP:
            blocks = blocks.view(len(blocks), -1)
            if counts is None:
                counts = [tokens.shape[-1]] * (tokens.shape[0] if tokens.dim() > 1 else 1)
            logits = [1] * len(counts) if logits is None else logits
            r, n, nb = len(counts), sum(counts), blocks.shape[1]
            ints = torch.cat([torch.tensor(counts + logits), positions.reshape(-1).cpu(),
                              blocks.reshape(-1).cpu()]).to(torch.int64)
            tokens = tokens.reshape(-1)
        else:
            r, n, nb, ints = cache_blocks, seq, block_size, None
        out = None
        if info.tensor == 1 and info.pipeline == 1:
            # A rank alone sends nothing.
            if op != OP_STOP:
                out = self._compute(op, r, n, ints, tokens, nb)
        else:
            out = self._send_and_compute(op, r, n, nb, tokens, ints)
        if op == OP_STEP:
            self.pending.append(out if info.pipeline == 1 else sum(logits))

    def _send_and_compute(self, op: int, r: int, n: int, nb: int, tokens, ints) -> torch.Tensor | None:
        """launch with other ranks: the step packed as messages, broadcast to this stage's TP
        ranks, computed here, then sent on to the next stage."""
        info = self.info
        if op == OP_STEP:
            tok_flat = tokens.to(torch.int64).cpu()
        else:
            # gloo does not move empty tensors: SETUP/STOP carry one unused int.
            ints, tok_flat = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        header = self._c(torch.tensor([op, r, n, nb], dtype=torch.int64))
        ints = self._c(ints)
        if info.tensor > 1:
            self._broadcast_step(header, self._c(torch.cat([tok_flat, ints.cpu()])) if op == OP_STEP else None)
        out = None
        if op != OP_STOP:
            out = self._compute(op, r, n, ints, tok_flat if op == OP_STEP else None, nb=nb)
        if info.pipeline > 1:
            self._forward_next(header, ints, self._c(out) if op == OP_STEP else None)
        return out

    def collect(self) -> torch.Tensor:
        """The logits asked for by the oldest launched step [K, V] (float32; K = sum of its rows'
        logits counts, in row order), on the device they were made or received on (sampling.choose
        brings back only what it needs)."""
        item = self.pending.popleft()
        if self.info.pipeline == 1:
            return item
        logits = torch.empty(item, self.vocab_size, dtype=torch.float32, device=self.comm_device)
        return _recv(logits, self.info.last_stage_rank0) if item else logits

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def _broadcast_step(self, header, ints) -> None:
        t0 = time.perf_counter()
        dist.broadcast(header, src=0, group=self.info.tp_group)
        if ints is not None:
            dist.broadcast(ints, src=0, group=self.info.tp_group)
        COMM.add(t0, header)

    def stop(self) -> None:
        self.launch(OP_STOP)
        self.sender.flush()

    # ---- every other rank --------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Follow rank 0's steps until it sends STOP."""
        info = self.info
        cd = self.comm_device
        while True:
            header = torch.empty(4, dtype=torch.int64, device=cd)
            if info.is_first:
                t0 = time.perf_counter()
                dist.broadcast(header, src=0, group=info.tp_group)
                op, r, n, nb = (int(v) for v in header.tolist())
                size = n + 2 * r + n + r * nb if op == OP_STEP else 0
                both = torch.empty(size, dtype=torch.int64, device=cd)
                if size:
                    dist.broadcast(both, src=0, group=info.tp_group)
                COMM.add(t0, both)
                x = both[:n].to(self.device) if op == OP_STEP else None
                ints = both[n:] if op == OP_STEP else torch.zeros(1, dtype=torch.int64, device=cd)
            else:
                _recv(header, info.prev_rank)
                op, r, n, nb = (int(v) for v in header.tolist())
                ints = _recv(torch.empty(2 * r + n + r * nb if op == OP_STEP else 1, dtype=torch.int64, device=cd),
                             info.prev_rank)
                x = None
                if op == OP_STEP:
                    x = _recv(torch.empty(n, self.hidden_size, dtype=self.dtype, device=cd),
                              info.prev_rank).to(self.device)
            if op == OP_STOP:
                if not info.is_last:
                    self._forward_next(header, ints, None)
                self.sender.flush()
                return
            out = self._compute(op, r, n, ints, x, nb=nb)
            if not info.is_last:
                self._forward_next(header, ints, None if out is None else self._c(out))
            elif op == OP_STEP and info.tp_rank == 0 and len(out):
                self.sender.send([self._c(out)], 0)
