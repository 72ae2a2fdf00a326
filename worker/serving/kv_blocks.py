"""Which block of the KV cache holds which tokens: the allocator behind the paged cache.

The cache of every layer is one pool of `num_blocks` blocks of `block_size` token positions
(model/attention.py KVCache). A request owns a block table: block j holds its positions
[j * block_size, (j + 1) * block_size). Blocks are taken as tokens arrive and given back when the
request ends, so the cache holds the tokens in use rather than a whole context per request.

Prefix reuse: a block whose positions are all written is registered under its tokens and those
of every block before it (a hash chain, checked token for token at each link). A new request whose
prompt starts with registered blocks shares them (reference-counted) and prefills only the rest.
A registered block nobody uses stays cached until its space is needed, least recently used first.

Contiguity: attention reads a row's blocks without a copy when they are consecutive, and a batch
of rows when their first blocks are evenly spaced (model/attention.py KVCache.read). So each engine row owns a
lane, an equal share of the pool, and its requests take their blocks from it in order; a request
that outgrows its lane borrows free blocks elsewhere, from the ends of other lanes first (the
positions a lane's own requests reach last), and pays for the copy on the steps that read it.

    block states:   free ──take──► owned (refs > 0) ──last release──► free
                                      │    ▲                      (registered: cached, LRU)
                               register    share                           │
                                      ▼    │                               │
                                  registered ◄───────── evicted when free runs out
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


@dataclass
class PoolStats:
    reused_tokens: int = 0        # prompt tokens found in cached blocks instead of prefilled
    evicted: int = 0              # cached blocks reclaimed for new tokens
    borrowed: int = 0             # blocks taken outside the taker's lane


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    lanes: int = 1
    prefix_cache: bool = True
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self):
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.lane_blocks = max(1, self.num_blocks // max(1, self.lanes))
        self.refs = [0] * self.num_blocks
        self.free = set(range(self.num_blocks))
        # Free blocks for a borrower: furthest into their lane first (lazy deletion: entries whose
        # block is no longer free are skipped).
        self._spare = [(-self._offset(b), b) for b in range(self.num_blocks)]
        heapq.heapify(self._spare)
        self.key_of: dict[int, tuple] = {}                       # registered block -> its key
        self.block_of: dict[tuple, int] = {}                     # key -> registered block
        self.evictable: OrderedDict[int, None] = OrderedDict()   # registered, unused; LRU first

    def _offset(self, block: int) -> int:
        """How far into its lane a block lies (blocks past the last whole lane: furthest)."""
        return block % self.lane_blocks if block < self.lane_blocks * self.lanes else self.lane_blocks

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks a request could take now: free ones and cached ones nobody uses."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    # ---- taking and giving back ---------------------------------------------------------------
    def take(self, lane: int, index: int) -> int | None:
        """A block for position block `index` of a request in `lane`: the lane's own block there if
        free, else a free block from another lane's end, else the least recently used cached
        block. None when every block is in use."""
        own = lane * self.lane_blocks + index
        if index < self.lane_blocks and own in self.free:
            block = own
        elif self.free:
            while True:
                _, block = heapq.heappop(self._spare)
                if block in self.free:
                    break
            self.stats.borrowed += 1
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            self.stats.evicted += 1
            self.refs[block] = 1
            return block
        else:
            return None
        self.free.discard(block)
        self.refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """A request is done with `blocks`: registered ones stay cached, the rest are free."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None          # most recently used: last out
                else:
                    self.free.add(block)
                    heapq.heappush(self._spare, (-self._offset(block), block))

    # ---- prefix reuse -----------------------------------------------------------------------
    def _keys(self, tokens: list[int], blocks: int):
        parent = 0
        for j in range(blocks):
            chunk = tuple(tokens[j * self.block_size:(j + 1) * self.block_size])
            key = (parent, chunk)
            yield key
            parent = hash(key)

    def match(self, tokens: list[int]) -> list[int]:
        """The registered blocks that hold the longest prefix of `tokens`, now shared by the
        caller (release them like its own). At least one token is left unmatched: the step that
        feeds it gives the next token's logits."""
        if not self.prefix_cache:
            return []
        found = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.block_size):
            block = self.block_of.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
        self.stats.reused_tokens += len(found) * self.block_size
        return found

    def register(self, tokens: list[int], blocks: list[int]) -> None:
        """`blocks` hold the positions of `tokens` (the request's fed tokens): register the full
        ones so later requests can share them. A block whose prefix another block already holds
        stays private (freed at release)."""
        if not self.prefix_cache:
            return
        for block, key in zip(blocks, self._keys(tokens, len(tokens) // self.block_size)):
            if block in self.key_of:
                continue
            if key in self.block_of:
                continue
            self.key_of[block] = key
            self.block_of[key] = block
