"""Each row's next token from its logits: greedy, or drawn after temperature, top-k and top-p, with
one random generator per request (seeded by the request's seed, so a seeded request draws the same
tokens whatever runs beside it), and the log-probabilities a request asks for.
"""
from __future__ import annotations

import torch

from shardwise.worker.serving.request import Request


def sample(logits: torch.Tensor, req: Request, generators: dict[int, torch.Generator]) -> int:
    """`req`'s token from its row's logits; `generators`: each sampling request's generator by
    request id, made on its first draw."""
    if req.temperature <= 0:
        # numpy's argmax: ~4 us over a 49k vocabulary where torch.argmax takes ~85 us (the same
        # first index on ties and NaN). Logits arrive as float32 on the CPU (Stage.collect).
        return int(logits.float().numpy().argmax())
    logits = logits.float() / req.temperature
    if req.top_k > 0:
        kth = torch.topk(logits, min(req.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if req.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < req.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    generator = generators.get(req.id)
    if generator is None:
        generator = generators[req.id] = torch.Generator()
        generator.manual_seed(req.seed if req.seed is not None else torch.seed())
    return int(torch.multinomial(probs, 1, generator=generator))


def choose(logits: torch.Tensor, reqs: list[Request], generators: dict[int, torch.Generator]) -> list[int]:
    """Each row's next token. Greedy rows on a GPU are picked there: a row's id comes back
    instead of its whole vocabulary (0.5 MB of float32 for Llama-3's 128k tokens)."""
    if logits.is_cuda and all(r.temperature <= 0 for r in reqs):
        return logits.argmax(-1).tolist()
    logits = logits.cpu()
    return [sample(logits[row], req, generators) for row, req in enumerate(reqs)]


def logprobs_of(logits: torch.Tensor, reqs: list[Request], tokens: list[int]) -> None:
    """Appends to each request that asked (logprobs is not None) the log-probability of its chosen
    token and its top-k alternatives, of the distribution the token was drawn from: log_softmax of
    the logits divided by the temperature (of the raw logits for greedy rows; top-p/top-k
    truncation is not applied). Only the rows that ask are computed, on the logits' own device;
    rows that do not ask cost one attribute check."""
    rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    if not rows:
        return
    asking = [reqs[i] for i in rows]
    x = (logits if len(rows) == len(reqs) else logits[torch.tensor(rows, device=logits.device)]).float()
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in asking],
                         dtype=torch.float32, device=x.device)
    lsm = torch.log_softmax(x / temps[:, None], dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], device=x.device)
    picked = lsm.gather(1, chosen[:, None])[:, 0].tolist()
    k = min(max(r.logprobs for r in asking), lsm.shape[-1])
    if k > 0:
        top = torch.topk(lsm, k, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    for j, r in enumerate(asking):
        alts = list(zip(ids[j][:r.logprobs], values[j][:r.logprobs])) if k > 0 and r.logprobs else []
        r.token_logprobs.append((picked[j], alts))


class Sampler:
    """The sampling functions above with the generators of the requests running now."""

    def __init__(self):
        self.generators: dict[int, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """Each row's token, its log-probabilities appended to the requests that ask."""
        tokens = choose(logits, reqs, self.generators)
        logprobs_of(logits, reqs, tokens)
        return tokens

    def forget(self, req: Request) -> None:
        """`req` ended: its generator goes (a preempted request keeps it, so its draws go on)."""
        self.generators.pop(req.id, None)
