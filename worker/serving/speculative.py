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
    draft     as the scheduler builds a step, each decoding row's proposal becomes its draft
              (Scheduler(speculator=...), SequenceState.draft): the row feeds its token and what
              the step's token budget, the context and the free blocks leave of the draft (drafts
              never preempt another request), and asks for the logits of each of those positions;
              rows of different lengths run in the same ragged step as the prompt chunks
    verify    each row's accepted drafts and its bonus token go to the request (only they count
              as cached: the rejected drafts' keys and values are overwritten later) and the blocks
              taken for the drafts beyond what the row now needs are given back

Verification is greedy, so greedy output is exactly what decoding without speculation gives. Rows
that sample (temperature > 0) or ask for log-probabilities are not speculated for: they feed their
one token, as without speculation; rejection sampling would keep a sampled row's distribution but
not the draws a seeded request makes today.
"""
from __future__ import annotations

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

    def proposal(self, seq) -> list[int]:
        """The draft of a decoding row (scheduler.SequenceState) as its step is built: the
        request's n-gram match, as many tokens as its drafting limit allows ([] for a request that
        does not speculate). The scheduler feeds what its budget, the context and the free blocks
        leave of it (Scheduler._draft)."""
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

    def verify(self, step, logits, sampler, scheduler) -> None:
        """A collected step some of whose decode rows fed drafts (scheduler.Step, its logits
        [sum(step.logits), vocabulary]): each ready row's first token as without speculation
        (greedy or sampled, from Step.next_logits), then for a row that fed k drafts, those equal
        to the greedy token at their position and the token after the last of them (the bonus).
        The blocks a row took for the drafts it did not keep are given back."""
        ready = step.ready
        first = sampler(logits[step.next_logits()], [step.seqs[i].req for i in ready])
        offsets, at = [], 0
        for n in step.logits:
            offsets.append(at)
            at += n
        # the greedy token after each draft token, for every drafting row at once
        checked = [offsets[i] + j for i in ready if step.logits[i] > 1 for j in range(1, step.logits[i])]
        greedy = logits[checked].argmax(-1).tolist() if checked else []
        stats = self.stats
        stats.steps += 1
        tokens, drafted = [], []
        for i, token in zip(ready, first):
            n = step.logits[i] - 1
            if n <= 0:
                tokens.append(token)
                continue
            drafts, after = step.tokens[i][1:], greedy[:n]
            del greedy[:n]
            a = accepted_drafts(drafts, [token] + after)
            stats.proposed += n
            stats.accepted += a
            drafting = self.indexes.get(step.seqs[i].req.id)
            if drafting is not None:
                drafting.update(n, a, self.config.draft_tokens)
            tokens.append(drafts[:a] + [token if a == 0 else after[a - 1]])
            drafted.append(step.seqs[i])
        scheduler.append_tokens(step, tokens)
        for s in drafted:           # a row that ended gave back every block already
            _give_back(scheduler.pool, s, s.fed + 1, scheduler.block_size)


def _give_back(pool, seq, positions: int, block_size: int) -> None:
    """Release `seq`'s blocks beyond those its first `positions` positions need."""
    need = blocks_for(positions, block_size)
    if seq.row >= 0 and len(seq.blocks) > need:
        pool.release(seq.blocks[need:])
        del seq.blocks[need:]
