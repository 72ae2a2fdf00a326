"""The choice of a replica for a request: the longest prefix of its prompt a replica probably holds
in its KV cache, weighed against the replica's load. Pure: no I/O, no clock.

The router has no tokenizer, so the prefix index works on text: the prompt is cut into blocks of
BLOCK_CHARS characters and each block's hash chains the hash of every block before it, so that one
hash names a whole prefix. Each replica remembers the hashes of the prompts routed to it (an LRU of
at most INDEX_ENTRIES); a request's cached prefix on a replica is the number of its leading blocks
found there. The index is approximate (a replica may have evicted a block, or got it from another
router replica), which costs only a less good choice, never a wrong answer.
"""
from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

BLOCK_CHARS = 64            # characters per prefix block (about 16 tokens of English text)
MAX_BLOCKS = 512            # blocks of one prompt looked at: 32 KiB of text, a bound on the work
INDEX_ENTRIES = 16384       # block hashes remembered per replica (an LRU): ~1 MiB per replica
# How many blocks of cached prefix are worth one request of load (running or waiting): a replica
# with 8 more blocks (512 characters) of the prompt cached is preferred over one with one request less.
BLOCKS_PER_REQUEST = 8


class Policy(str, enum.Enum):
    PREFIX = "prefix"               # longest cached prefix against load
    ROUND_ROBIN = "round-robin"     # each Ready replica in turn (for comparison)


def block_hashes(text: str, block: int = BLOCK_CHARS, limit: int = MAX_BLOCKS) -> list[bytes]:
    """The chained hashes of `text`'s whole blocks: hash i names the prefix of i + 1 blocks."""
    out, prev = [], b""
    for start in range(0, min(len(text), block * limit) - block + 1, block):
        prev = hashlib.blake2b(prev + text[start:start + block].encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """The prefix blocks a replica probably holds: an LRU of block hashes, bounded."""

    def __init__(self, capacity: int = INDEX_ENTRIES):
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt are held (the chain stops at the first miss)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


@dataclass
class Replica:
    """One replica as the router sees it."""
    address: str                    # base URL, http://host:port
    ready: bool = False             # its /healthz answered 200 on the last check
    running: int = 0                # requests this router has in flight on it
    reported_running: int = 0       # what its last /healthz said it runs (all routers' requests)
    waiting: int = 0                # and what it said it has queued
    index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> int:
        # this router's own count is current; the replica's covers other router replicas too
        return max(self.running, self.reported_running) + self.waiting


def score(replica: Replica, hashes: list[bytes]) -> float:
    """Higher is better: blocks of the prompt cached there, less its load in block units."""
    return replica.index.matched(hashes) - BLOCKS_PER_REQUEST * replica.load


def choose(replicas: list[Replica], hashes: list[bytes], policy: Policy = Policy.PREFIX,
           turn: int = 0, exclude: frozenset[str] = frozenset()) -> Replica | None:
    """The Ready replica (not in `exclude`) for a prompt of these block hashes, or None.
    Round robin takes the `turn`-th Ready replica; prefix takes the best score, ties going to the
    least loaded, then to the order of `turn` (so that equal replicas share the load)."""
    ready = [r for r in replicas if r.ready and r.address not in exclude]
    if not ready:
        return None
    if policy == Policy.ROUND_ROBIN:
        return ready[turn % len(ready)]
    n = len(ready)
    return max(enumerate(ready), key=lambda ir: (score(ir[1], hashes), -ir[1].load, -((ir[0] - turn) % n)))[1]


def prompt_text(body: dict, chat: bool) -> str:
    """The text whose prefix a request shares with others: the prompt, or each message's role and
    content in order. Anything unexpected counts as no text (the request is still forwarded; the
    replica validates it)."""
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and all(isinstance(t, int) for t in p[:MAX_BLOCKS * BLOCK_CHARS]):
            return " ".join(map(str, p[:MAX_BLOCKS * 8]))
        return p if isinstance(p, str) else ""
    parts = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            return ""
        c = m.get("content")
        if isinstance(c, list):
            c = "\n".join(x.get("text", "") for x in c if isinstance(x, dict) and isinstance(x.get("text"), str))
        parts.append(f"<{m.get('role')}>{c if isinstance(c, str) else ''}")
    return "".join(parts)
