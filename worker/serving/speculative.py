"""Speculative decoding by prompt lookup: drafts taken from the sequence itself, no second model.

Text that repeats what came before (code being edited, a document being summarised or quoted, a
list being continued) is cheap to guess: when the last few tokens of a sequence occurred earlier in
its prompt or output, the tokens that followed them there are likely to follow again. A decoding row
then feeds its last token plus up to k such drafts as one row of 1+k tokens, and one forward gives
the target's logits at every position: the drafts that equal the greedy token at their position are
accepted, and the position after the last accepted one gives one more token (the bonus), so a step
yields 1 to k+1 tokens for about the weight reads of one (decode is memory-bound).

    propose   the longest recent n-gram (n from ngram_max down to ngram_min) of the sequence's last
              tokens matched earlier in prompt+output; the up to k tokens that followed its most
              recent earlier occurrence (NgramIndex keeps each request's n-grams, updated as it grows);
              k shrinks for a request whose drafts are rejected and grows back as they are accepted
    draft     a decode step's rows get their drafts; every row feeds 1+K tokens, K the most any row
              proposes, capped by what every row can hold: blocks are taken only where free (drafts
              never preempt another request) and positions stay inside the context
    verify    each row's accepted drafts and its bonus token go to the request, its cached length
              is rolled back past the rejected drafts (their keys and values are overwritten later)
              and the blocks taken for them beyond what the row now needs are given back

Verification is greedy, so greedy output is exactly what decoding without speculation gives. Rows
that sample (temperature > 0) or ask for log-probabilities are not speculated for: they feed padding
after their token (never verified) and take their token from the first position, as without
speculation; rejection sampling would keep a sampled row's distribution but not the draws a seeded
request makes today.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardwise.crds.speculative import DRAFT_TOKENS_MAX, NGRAM_LIMIT
from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.kv_blocks import blocks_for


@dataclass(frozen=True)
class SpeculativeConfig:
    """k: draft tokens per row and step; n-grams of ngram_min..ngram_max tokens are looked up."""
    draft_tokens: int
    ngram_min: int
    ngram_max: int

    def __post_init__(self):
        if not 1 <= self.draft_tokens <= DRAFT_TOKENS_MAX:
            raise WorkerError(f"--draft-tokens must be 1 to {DRAFT_TOKENS_MAX}, not {self.draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= NGRAM_LIMIT:
            raise WorkerError(f"--ngram must be MIN:MAX with 1 <= MIN <= MAX <= {NGRAM_LIMIT}, "
                              f"not {self.ngram_min}:{self.ngram_max}")


@dataclass
class SpeculativeStats:
    """Counts since the engine started: drafts fed for verification, and those accepted."""
    steps: int = 0               # verification steps collected
    proposed: int = 0            # draft tokens fed to be verified
    accepted: int = 0            # of them, equal to the target's greedy token

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class Drafting:
    """A request's n-grams and how many drafts it is given next: while its drafts are all accepted
    the limit grows by 2 (up to k); a rejection sets it to one more than were accepted, so a
    request whose text stops repeating soon feeds one draft a step, not k, and one whose text
    repeats again is back at k within a few steps."""
    index: "NgramIndex"
    limit: int

    def update(self, fed: int, accepted: int, k: int) -> None:
        if fed:
            self.limit = min(k, self.limit + 2) if accepted == fed else max(1, accepted + 1)


class NgramIndex:
    """One request's n-grams: for each n, the end of the most recent occurrence of each n-gram
    among the positions indexed so far (every end before the sequence's last token)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)           # longest first
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0                                           # ends 1..indexed are in the tables

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest n-gram
        ending `seq` ([] when none occurred before)."""
        end = len(seq)
        for e in range(self.indexed + 1, end):          # the tail itself is not a match of itself
            for n, table in self.tables.items():
                if e >= n:
                    table[tuple(seq[e - n:e])] = e
        self.indexed = max(self.indexed, end - 1)
        if k < 1:
            return []
        for n in self.sizes:
            if end > n:
                e = self.tables[n].get(tuple(seq[end - n:]))
                if e is not None:
                    return seq[e:e + k]
        return []


def propose(seq: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    """The drafts of `seq` with a fresh index (NgramIndex.propose): for a one-off lookup."""
    return NgramIndex(ngram_min, ngram_max).propose(seq, k)


def accepted_drafts(drafts: list[int], greedy: list[int]) -> int:
    """How many leading drafts equal the target's greedy token at their position: `greedy[i]` is
    the argmax after the row's token and drafts[:i] (len(greedy) > len(drafts))."""
    n = 0
    while n < len(drafts) and drafts[n] == greedy[n]:
        n += 1
    return n


def speculates(req) -> bool:
    """Whether a request's tokens may come from verified drafts: greedy, no log-probabilities."""
    return req.temperature <= 0 and req.logprobs is None


class Speculator:
    """Prompt-lookup drafts for an engine's decode steps, and their verification (module doc)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.indexes: dict[int, Drafting] = {}          # by request id, while it runs
        self.stats = SpeculativeStats()

    def forget(self, req) -> None:
        """`req` ended: its n-grams go."""
        self.indexes.pop(req.id, None)

    def _proposal(self, seq) -> list[int]:
        req = seq.req
        if not speculates(req):
            return []
        drafting = self.indexes.get(req.id)
        if drafting is None:
            drafting = self.indexes[req.id] = Drafting(NgramIndex(self.config.ngram_min, self.config.ngram_max),
                                                       self.config.draft_tokens)
        # the bonus token always comes: drafts past max_new_tokens - 1 could never be used
        k = min(drafting.limit, req.max_new_tokens - len(req.token_ids) - 1)
        return drafting.index.propose(req.sequence(), k)

    def draft(self, step, scheduler) -> None:
        """Give a decode `step` (scheduler.Step of one token per row) its rows' drafts, in place:
        every row feeds 1+K tokens (`step.drafts`: how many of them each row has verified), or the
        step stays as it was when no row proposes or no room is left."""
        pool, bs = scheduler.pool, scheduler.block_size
        proposals = [self._proposal(s) for s in step.seqs]
        want = max(map(len, proposals), default=0)
        if want == 0:
            return
        room = want
        for s in step.seqs:
            room = min(room, scheduler.max_seq - 1 - s.fed)
            while room > 0 and len(s.blocks) < blocks_for(s.fed + 1 + room, bs):
                block = pool.take(s.row, len(s.blocks))         # free or cached blocks only
                if block is None:
                    break
                s.blocks.append(block)
            room = min(room, len(s.blocks) * bs - s.fed - 1)
        if room <= 0:
            for s in step.seqs:
                _give_back(pool, s, s.fed + 1, bs)
            return
        for row, proposal in zip(step.tokens, proposals):
            proposal = proposal[:room]
            # padding (never verified) so that every row feeds as many tokens
            row.extend(proposal + [proposal[-1] if proposal else row[0]] * (room - len(proposal)))
        step.drafts = [min(len(p), room) for p in proposals]
        step.fed = 1 + room
        step.tables = scheduler._tables(step.seqs, max(step.starts) + step.fed)

    def verify(self, step, logits, sampler, scheduler) -> None:
        """A collected verification step: each row's first token as without speculation (greedy or
        sampled), then its accepted drafts and the bonus token; cached lengths rolled back past
        the rejected drafts (`complete` counted every fed token) and unneeded blocks given back.
        `logits`: [rows, 1+K, vocabulary]."""
        first = sampler(logits[:, 0], step.requests)
        greedy = logits[:, 1:].argmax(-1).tolist() if any(step.drafts) else [[]] * len(step.seqs)
        stats = self.stats
        stats.steps += 1
        tokens = []
        for i, s in enumerate(step.seqs):
            n = step.drafts[i]
            drafts = step.tokens[i][1:1 + n]
            a = accepted_drafts(drafts, [first[i]] + greedy[i])
            stats.proposed += n
            stats.accepted += a
            drafting = self.indexes.get(s.req.id)
            if drafting is not None:
                drafting.update(n, a, self.config.draft_tokens)
            s.fed -= step.fed - 1 - a           # the last token and the accepted drafts stay cached
            tokens.append(drafts[:a] + [first[i] if a == 0 else greedy[i][a - 1]])
            _give_back(scheduler.pool, s, s.fed + 1, scheduler.block_size)
        self._append(step, tokens, scheduler)

    @staticmethod
    def _append(step, tokens: list[list[int]], scheduler) -> None:
        """Hand each row its tokens one at a time, as decode steps would, its cached length what
        it would be then: a row that ends on one of them (end token, stop, length) takes no more."""
        ends = [s.fed for s in step.seqs]
        for j in range(max(map(len, tokens))):
            rows = [i for i, s in enumerate(step.seqs)
                    if j < len(tokens[i]) and s.row >= 0 and s.req.finish_reason is None]
            if not rows:
                return
            for i in rows:
                step.seqs[i].fed = ends[i] - len(tokens[i]) + 1 + j
            scheduler.append_tokens(dataclasses.replace(step, seqs=[step.seqs[i] for i in rows]),
                                    [tokens[i][j] for i in rows])


def _give_back(pool, seq, positions: int, block_size: int) -> None:
    """Release `seq`'s blocks beyond those its first `positions` positions need."""
    need = blocks_for(positions, block_size)
    if seq.row >= 0 and len(seq.blocks) > need:
        pool.release(seq.blocks[need:])
        del seq.blocks[need:]
