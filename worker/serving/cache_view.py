"""The paged KV cache's index: from a step's positions and block tables (kv_blocks.py) to the
model's view of the cache for that step (model.attention.CacheStep): where each new key and value
goes, what each row attends to, and whether the rows can be read in place.

The model reads and writes only the places it is given, so the block layout stays here, next to
the blocks. Two kinds of view: the paged one (host-side decisions, the fewest device ops) and the
static-shape one a CUDA graph replays (fixed shapes, device ops only, no host syncs), and the
ragged one of a step whose rows feed different numbers of tokens (ragged_view).
"""
from __future__ import annotations

import torch

from shardwise.worker.model.attention import CacheStep, RowGroup
from shardwise.worker.serving.kv_blocks import blocks_for


def token_slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The token slots of `positions` [B, T] for rows with block tables `blocks` [B, nb]: device
    ops only (no host sync), for prefill chunks and CUDA graphs."""
    return torch.gather(blocks, 1, positions // block_size) * block_size + positions % block_size


def first_slots(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The token slots of every row's positions 0..length-1 [B, length] (token_slots)."""
    everything = torch.arange(length, device=blocks.device).expand(len(blocks), length)
    return token_slots(blocks, everything, block_size)


def cache_index(slots: torch.Tensor, kv_heads: int, tokens: int) -> torch.Tensor:
    """Places in a KVCache viewed as [-1, head_dim] of token `slots` [B, T], ordered (row, kv head,
    token) as k.reshape(-1, head_dim) of k [B, kv, T, hd]."""
    heads = torch.arange(kv_heads, device=slots.device) * tokens
    return (heads[None, :, None] + slots[:, None, :]).reshape(-1)


def in_place(tables: list[list[int]], ends: list[int], length: int, block_size: int, tokens: int):
    """(start, stride) when every row's first `ends[b]` positions lie on consecutive blocks and the
    rows' first blocks are evenly spaced, so the batch reads as one strided view (KVCache.read)
    of `length` positions per row; None otherwise. Positions past a row's own end read whatever
    follows it in the pool and are masked."""
    starts = []
    for table, end in zip(tables, ends):
        first, n = table[0], blocks_for(end, block_size)
        if table[n - 1] != first + n - 1 or table[:n] != list(range(first, first + n)):
            return None
        starts.append(first * block_size)
    stride = starts[1] - starts[0] if len(starts) > 1 else 0
    if len(starts) > 1 and (stride <= 0 or any(b - a != stride for a, b in zip(starts, starts[1:]))):
        return None
    if starts[-1] + length > tokens:
        return None
    return starts[0], stride


def static_view(model, positions: torch.Tensor, blocks: torch.Tensor) -> CacheStep:
    """Fixed shapes and no host syncs, for CUDA graphs: every row gathered over the whole context,
    masked (each row is one block there: cuda_graphs.py)."""
    bs, tokens, kv_heads, length = model.block_size, model.cache_tokens, model.kv_heads, model.max_seq
    mask = torch.arange(length, device=positions.device)[None, None, :] <= positions[:, :, None]
    gather = cache_index(first_slots(blocks, length, bs), kv_heads, tokens)
    index = cache_index(token_slots(blocks, positions, bs), kv_heads, tokens)
    return CacheStep(index, length, False, mask, None, 0, gather)


def paged_view(model, positions: torch.Tensor, blocks: torch.Tensor) -> CacheStep:
    """The view of a step on the paged cache, its decisions taken on host copies of positions
    and tables: one copy each instead of several small device ops and syncs."""
    bs, tokens, kv_heads = model.block_size, model.cache_tokens, model.kv_heads
    t = positions.shape[1]
    rows, tables = positions.tolist(), blocks.tolist()
    length = max(max(row) for row in rows) + 1
    # A prefill that starts every row at position 0 needs only causal attention over its own
    # keys; a decode step whose rows all sit at the last position attends to everything
    # cached; otherwise row b attends to the cached positions up to its own.
    fresh = t > 1 and all(row[0] == 0 for row in rows)
    full = t == 1 and all(row[0] == length - 1 for row in rows)
    mask = None
    if not (fresh or full):
        mask = torch.arange(length, device=positions.device)[None, None, :] <= positions[:, :, None]
    if t > 1:
        index = cache_index(token_slots(blocks, positions, bs), kv_heads, tokens)
    else:       # one token per row, from host ints: one tensor instead of several small ops
        index = torch.tensor([head * tokens + table[p // bs] * bs + p % bs
                              for table, (p,) in zip(tables, rows) for head in range(kv_heads)],
                             device=positions.device)
    if fresh:
        return CacheStep(index, length, fresh, mask)
    view = in_place(tables, [row[-1] + 1 for row in rows], length, bs, tokens)
    if view is not None:
        return CacheStep(index, length, fresh, mask, *view)
    # Tables cover every row up to `length` (the engine pads them), so positions past a
    # row's own end gather some block's slots, masked.
    gather = cache_index(first_slots(blocks, length, bs), kv_heads, tokens)
    return CacheStep(index, length, fresh, mask, None, 0, gather)


def _group(model, rows: list[int], offsets: list[int], counts: list[int], pos: list[int],
           tables: list[list[int]], blocks: torch.Tensor) -> RowGroup:
    """The rows `rows` of a ragged step as one dense batch of the most tokens any of them feeds
    (a shorter row repeats its last token, whose result is dropped): which of the step's tokens
    they query, what they read of the cache, and where their results go."""
    bs, tokens, kv_heads = model.block_size, model.cache_tokens, model.kv_heads
    device = blocks.device
    t = max(counts[r] for r in rows)
    query = [offsets[r] + min(i, counts[r] - 1) for r in rows for i in range(t)]
    qpos = [pos[q] for q in query]
    length = max(qpos) + 1
    ends = [pos[offsets[r] + counts[r] - 1] + 1 for r in rows]
    mask = None
    if t > 1 or any(e != length for e in ends):
        mask = torch.arange(length, device=device)[None, None, :] <= \
            torch.tensor(qpos, device=device).view(len(rows), t, 1)
    group_tables = [tables[r] for r in rows]
    view = in_place(group_tables, ends, length, bs, tokens)
    if view is not None:
        read = CacheStep(None, length, False, mask, *view)
    else:
        mine = blocks.index_select(0, torch.tensor(rows, device=device))
        read = CacheStep(None, length, False, mask, None, 0,
                         cache_index(first_slots(mine, length, bs), kv_heads, tokens))
    real = [j * t + i for j, r in enumerate(rows) for i in range(counts[r])]
    dest = [offsets[r] + i for r in rows for i in range(counts[r])]
    keep = None if len(real) == len(query) else torch.tensor(real, device=device)
    return RowGroup(len(rows), t, torch.tensor(query, device=device), read, torch.tensor(dest, device=device), keep)


def ragged_view(model, counts: list[int], positions: torch.Tensor, blocks: torch.Tensor,
                causal_fresh: bool = True) -> CacheStep:
    """The view of a step whose row b feeds counts[b] tokens, flattened into one row of all N
    tokens at `positions` [N] (row by row), over block tables `blocks` [rows, nb]: every key is
    written at once; a row that feeds several tokens from position 0 (a prompt's first chunk)
    attends causally to its own keys (CacheStep.spans), and the others in two groups, those that
    feed one token (decodes: the fast decode kernel) and those that feed several (later prompt
    chunks, drafts), each row to its own cached positions up to each of its own
    (attention.ragged_attention). `causal_fresh=False`: fresh rows go with the later chunks
    (benchmarks/ragged_step_bench.py measures the difference)."""
    bs, tokens, kv_heads = model.block_size, model.cache_tokens, model.kv_heads
    pos, tables = positions.tolist(), blocks.tolist()
    offsets, at = [], 0
    for c in counts:
        offsets.append(at)
        at += c
    slots = [tables[r][pos[o + i] // bs] * bs + pos[o + i] % bs
             for r, (o, c) in enumerate(zip(offsets, counts)) for i in range(c)]
    index = cache_index(torch.tensor(slots, device=positions.device)[None], kv_heads, tokens)
    singles = [r for r, c in enumerate(counts) if c == 1]
    # a prompt's first chunk needs nothing of the cache: the causal kernel over its own keys
    fresh = [r for r, c in enumerate(counts) if c > 1 and pos[offsets[r]] == 0 and causal_fresh]
    several = [r for r, c in enumerate(counts) if c > 1 and r not in fresh]
    groups = [_group(model, rows, offsets, counts, pos, tables, blocks) for rows in (singles, several) if rows]
    spans = [(offsets[r], offsets[r] + counts[r]) for r in fresh]
    return CacheStep(index, max(pos) + 1, False, None, groups=groups, spans=spans)


def cache_view(model, positions: torch.Tensor, blocks: torch.Tensor, static_shapes: bool = False) -> CacheStep:
    """The model's view of the cache (set up by model.setup_caches) for a step at `positions`
    [B, T] whose rows hold the blocks of their tables `blocks` [B, nb] ([B]: one block per row, a
    fixed row of the whole context). `static_shapes`: the CUDA graph kind (static_view)."""
    if blocks.dim() == 1:
        blocks = blocks[:, None]
    return (static_view if static_shapes else paged_view)(model, positions, blocks)
