"""Each row's next token from its logits: greedy, or drawn after temperature, top-k and top-p, and
the log-probabilities a request asks for.

Sampled rows are drawn together, in batched tensor operations on the logits' own device (the
GPU's, on a GPU): per-row temperatures, top-k and top-p come as tensors, and only the token ids
(and the log-probabilities asked for) come back to the host. Each row is drawn by inverse
transform: one uniform number per row, from the request's own random generator (seeded by its
seed, so a seeded request draws the same tokens whatever runs beside it), against the cumulative
sum of its kept probabilities. One number per row is drawn on the host, where a generator per
request costs ~0.1 us, instead of a vocabulary of noise per row on the device.

Greedy rows take the first largest logit: on the CPU with numpy's argmax (~4 us over a 49k
vocabulary, where torch.argmax takes ~85 us), on a GPU on the device.
"""
from __future__ import annotations

import random

import torch

from shardwise.worker.serving.request import Request

# A row's uniform number has this many bits: exact in float32, and at most 1 - 2**-23, so that u
# times a float32 total stays below the total and the draw never lands past the last kept token.
_UNIFORM_BITS = 23
# Top-p without top-k first looks for its nucleus among this many likeliest tokens (a top-k, far
# cheaper than sorting the vocabulary); a row whose nucleus is larger falls back to the sort.
NUCLEUS_CANDIDATES = 1024


def _uniform(req: Request, generators: dict[int, random.Random]) -> float:
    """`req`'s next uniform number in [0, 1) from its generator, made on its first draw."""
    rng = generators.get(req.id)
    if rng is None:
        # None: seeded from the OS. Modulo 2**64, as torch takes a seed: Python's generator seeds
        # with a number's magnitude, so -5 and 5 would draw alike.
        seed = None if req.seed is None else req.seed % (1 << 64)
        rng = generators[req.id] = random.Random(seed)
    return rng.getrandbits(_UNIFORM_BITS) / (1 << _UNIFORM_BITS)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's column [B, 1] drawn with probability proportional to its `weights` [B, C]
    (non-negative, float32), given one uniform number per row `u` [B]. A column of weight 0 is
    never drawn: its running sum equals its predecessor's."""
    cdf = torch.cumsum(weights, -1)
    picked = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)
    return picked.clamp_(max=cdf.shape[-1] - 1)


def _truncated(x: torch.Tensor, ks: list[int], ps: list[float], whole: bool = False):
    """The likeliest tokens of rows that truncate: (probabilities [B, C] of their full
    distribution, zero outside their top-k and top-p, token ids [B, C]), or None when a row's
    nucleus lies beyond NUCLEUS_CANDIDATES (`whole`: look in the whole vocabulary, sorted)."""
    vocab, dev = x.shape[-1], x.device
    has_k = [0 < k < vocab for k in ks]
    width = max(ks) if all(has_k) else vocab if whole else min(vocab, max(NUCLEUS_CANDIDATES, max(ks)))
    scores, ids = torch.topk(x, width, dim=-1) if width < vocab else torch.sort(x, dim=-1, descending=True)
    k = torch.tensor([k if h else width for k, h in zip(ks, has_k)], device=dev)
    scores = scores.masked_fill(torch.arange(width, device=dev)[None, :] >= k[:, None], float("-inf"))
    # Normalized over a row's top-k, or over its whole vocabulary when it has none.
    lse = torch.logsumexp(scores, -1)
    topped = torch.tensor(has_k, device=dev)
    if not all(has_k):
        lse = torch.where(topped, lse, torch.logsumexp(x, -1))
    probs = torch.exp(scores - lse[:, None])
    p = torch.tensor([p if p < 1.0 else 2.0 for p in ps], dtype=torch.float32, device=dev)
    before = torch.cumsum(probs, -1) - probs            # the mass of the likelier tokens
    # A row without top-k whose candidates fall short of its top_p: its nucleus reaches further.
    if width < vocab and not all(has_k) and bool(((before[:, -1] + probs[:, -1] < p) & ~topped).any()):
        return None
    return probs * (before < p[:, None]), ids


def draw(logits: torch.Tensor, reqs: list[Request], generators: dict[int, random.Random]) -> torch.Tensor:
    """Each row's token [B] (int64, on the logits' device), drawn from its temperature-scaled
    distribution truncated to its top-k and top-p; `reqs` all sample (temperature > 0)."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    x = logits.float() / temps[:, None]
    u = torch.tensor([_uniform(r, generators) for r in reqs], dtype=torch.float32, device=dev)
    whole = [i for i, r in enumerate(reqs) if not 0 < r.top_k < vocab and r.top_p >= 1.0]
    if len(whole) == len(reqs):
        return _inverse_cdf(torch.exp(x - x.amax(-1, keepdim=True)), u)[:, 0]
    out = torch.empty(len(reqs), dtype=torch.int64, device=dev)
    if whole:
        rows = torch.tensor(whole, device=dev)
        xs = x[rows]
        out.index_copy_(0, rows, _inverse_cdf(torch.exp(xs - xs.amax(-1, keepdim=True)), u[rows])[:, 0])
    cut = [i for i in range(len(reqs)) if i not in set(whole)]
    rows = torch.tensor(cut, device=dev)
    xs = x if not whole else x[rows]
    ks, ps = [reqs[i].top_k for i in cut], [reqs[i].top_p for i in cut]
    kept = _truncated(xs, ks, ps)
    if kept is None:                                      # a nucleus wider than the candidates
        kept = _truncated(xs, ks, ps, whole=True)
    probs, ids = kept
    out.index_copy_(0, rows, ids.gather(1, _inverse_cdf(probs, u[rows]))[:, 0])
    return out


def choose(logits: torch.Tensor, reqs: list[Request], generators: dict[int, random.Random]) -> list[int]:
    """Each row's next token; `generators`: each sampling request's generator by request id.
    Greedy rows on a GPU are picked there: a row's id comes back instead of its whole
    vocabulary (0.5 MB of float32 for Llama-3's 128k tokens)."""
    sampled = [i for i, r in enumerate(reqs) if r.temperature > 0]
    if not sampled:
        if logits.is_cuda:
            return logits.argmax(-1).tolist()
        return logits.float().numpy().argmax(-1).tolist()
    if len(sampled) == len(reqs):
        return draw(logits, reqs, generators).tolist()
    rows = torch.tensor(sampled, device=logits.device)
    drawn = draw(logits[rows], [reqs[i] for i in sampled], generators)
    if logits.is_cuda:          # one copy back: the greedy picks merged on the device
        return logits.argmax(-1).index_copy_(0, rows, drawn).tolist()
    tokens = logits.float().numpy().argmax(-1)
    tokens[sampled] = drawn.numpy()
    return tokens.tolist()


def logprobs_of(logits: torch.Tensor, reqs: list[Request], tokens: list[int]) -> None:
    """Appends to each request that asked (logprobs is not None) the log-probability of its chosen
    token and its top-k alternatives, of the distribution the token was drawn from: log_softmax of
    the logits divided by the temperature (of the raw logits for greedy rows; top-p/top-k
    truncation is not applied). Only the rows that ask are computed, on the logits' own device,
    and only their numbers come back; rows that do not ask cost one attribute check."""
    rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    if not rows:
        return
    asking = [reqs[i] for i in rows]
    x = (logits if len(rows) == len(reqs) else logits[torch.tensor(rows, device=logits.device)]).float()
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in asking],
                         dtype=torch.float32, device=x.device)
    lsm = torch.log_softmax(x / temps[:, None], dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=x.device)
    picked = lsm.gather(1, chosen[:, None])[:, 0]
    k = min(max(r.logprobs for r in asking), lsm.shape[-1])
    if k > 0:
        top = torch.topk(lsm, k, dim=-1)
        # one copy back: the chosen tokens' and the alternatives' numbers together
        both = torch.cat([picked[:, None], top.values, top.indices.to(torch.float32)], 1).tolist()
    else:
        both = picked[:, None].tolist()
    for r, row in zip(asking, both):
        n = r.logprobs
        alts = [(int(i), v) for i, v in zip(row[1 + k:1 + k + n], row[1:1 + n])] if k > 0 else []
        r.token_logprobs.append((row[0], alts))


class Sampler:
    """The sampling functions above with the generators of the requests running now."""

    def __init__(self):
        self.generators: dict[int, random.Random] = {}

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """Each row's token, its log-probabilities appended to the requests that ask."""
        tokens = choose(logits, reqs, self.generators)
        logprobs_of(logits, reqs, tokens)
        return tokens

    def forget(self, req: Request) -> None:
        """`req` ended: its generator goes (a preempted request keeps it, so its draws go on)."""
        self.generators.pop(req.id, None)
