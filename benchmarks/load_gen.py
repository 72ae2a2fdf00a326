"""The load benchmark's parts that know no server: the workload, the HTTP driver and the report.

Workload. Prompt and answer lengths are drawn from log-normal distributions, the shape that the
lengths of real chat traffic follow (a long right tail: most prompts short, a few very long).
No dataset is downloaded, so the distributions are fitted to published statistics: the ShareGPT
conversations as used by vLLM's evaluation (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023, section 6.1) average about 161 input and
338 output tokens. The default prompt mean is that 161; the default answer mean is 64 tokens, not
338, so that a run on two CPU cores ends in minutes (`--output-mean 338` gives ShareGPT's). The
spread (sigma of the underlying normal, 1.0 for prompts and 0.6 for answers) gives those published
histograms' long tails; lengths are clipped to [--input-min, --input-max] and [--output-min,
--output-max]. Everything is drawn from one seeded random generator, so two servers (and two runs)
get the same requests in the same order.

Prompt text is a window of benchmarks/data/river.txt (repeated) at a random offset, headed by the
request's number, so that no two requests share a prefix by accident; about 1.3 tokens per word
(the server's usage says how many tokens it counted, and the report shows it). Prefix sharing is a
knob: a fraction (--shared-prefix) of the requests start with one of a few (--prefixes) long
system prompts (--prefix-tokens), as requests of one application do.

Token counts. Every request asks for exactly its drawn answer length: `max_tokens` and
`ignore_eos: true` (llama.cpp's server honours it; a server that does not know it ignores it).
Each answer's tokens are counted from the stream's usage (`stream_options.include_usage`), or one
per text chunk when a server sends no usage; an answer shorter than asked (the server stopped on
an end token) is reported as `short`, so that two servers' tokens/s compare only when both
generated every token asked.

Latencies: time to first token (TTFT) from sending the request to its first text chunk;
inter-token latency (ITL) the gaps between successive text chunks of one answer, all answers
pooled; percentiles by linear interpolation between ranks (numpy's default).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS_PER_WORD = 1.3
MAX_ERROR_CHARS = 200            # the first error of each kind is kept, cut to this


@dataclass(frozen=True)
class LogNormal:
    """Integer lengths from a log-normal of the given mean, clipped to [lo, hi]."""
    mean: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rnd: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma ** 2 / 2         # so that E[X] = mean before clipping
        return max(self.lo, min(self.hi, round(rnd.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True)
class Workload:
    inputs: LogNormal = LogNormal(161, 1.0, 8, 1024)
    outputs: LogNormal = LogNormal(64, 0.6, 8, 160)
    shared_prefix: float = 0.0          # fraction of requests that start with a shared system prompt
    prefixes: int = 4
    prefix_tokens: int = 500
    seed: int = 0


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    system: str | None            # the shared system prompt it starts with, or None
    max_tokens: int
    prompt_words: int


def _words() -> list[str]:
    with open(os.path.join(HERE, "data", "river.txt")) as f:
        return f.read().split()


def _text(words: list[str], start: int, count: int) -> str:
    return " ".join(words[(start + i) % len(words)] for i in range(count))


def make_requests(w: Workload, n: int) -> list[RequestSpec]:
    """n requests drawn from the workload, the same ones for the same seed."""
    rnd, words = random.Random(w.seed), _words()
    prefix_words = max(1, round(w.prefix_tokens / TOKENS_PER_WORD))
    systems = [f"System prompt {k}. " + _text(words, rnd.randrange(len(words)), prefix_words)
               for k in range(w.prefixes)]
    out = []
    for i in range(n):
        count = max(1, round(w.inputs.sample(rnd) / TOKENS_PER_WORD))
        system = rnd.choice(systems) if systems and rnd.random() < w.shared_prefix else None
        prompt = f"Note {i}. " + _text(words, rnd.randrange(len(words)), count)
        out.append(RequestSpec(prompt, system, w.outputs.sample(rnd), count))
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks; nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Outcome:
    """What one request saw."""
    ok: bool = False
    asked: int = 0
    tokens: int = 0
    prompt_tokens: int | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None


def body(spec: RequestSpec, chat: bool, temperature: float, model: str | None) -> dict:
    b = {"max_tokens": spec.max_tokens, "temperature": temperature, "stream": True,
         "stream_options": {"include_usage": True}, "ignore_eos": True}
    if model:
        b["model"] = model
    if chat:
        b["messages"] = ([{"role": "system", "content": spec.system}] if spec.system else []) + \
            [{"role": "user", "content": spec.prompt}]
    else:
        b["prompt"] = (spec.system + "\n\n" if spec.system else "") + spec.prompt
    return b


def _chunk_text(event: dict, chat: bool) -> str:
    parts = []
    for c in event.get("choices") or []:
        parts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(parts)


def _read_event(out: Outcome, event: dict, chat: bool, now: float, last: list[float]) -> None:
    if _chunk_text(event, chat):
        if out.ttft is None:
            out.ttft = now - last[0]
        else:
            out.gaps.append(now - last[0])
        last[0] = now
        out.tokens += 1                        # replaced by the usage when the server sends one
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        out.tokens = usage["completion_tokens"]
        out.prompt_tokens = usage.get("prompt_tokens")


async def one_request(session, url: str, payload: dict, chat: bool, timeout: float) -> Outcome:
    """Send one streamed request; never raises: a failure is recorded in the outcome."""
    import aiohttp
    out = Outcome(asked=payload["max_tokens"])
    last = [time.perf_counter()]
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:MAX_ERROR_CHARS]
                return _failed(out, f"HTTP {resp.status}", text)
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return _failed(out, "error event", json.dumps(event["error"])[:MAX_ERROR_CHARS])
                _read_event(out, event, chat, time.perf_counter(), last)
    except Exception as e:            # noqa: BLE001 - any failure is one of the figures
        return _failed(out, type(e).__name__, str(e)[:MAX_ERROR_CHARS] or repr(e)[:MAX_ERROR_CHARS])
    if out.ttft is None:
        return _failed(out, "no tokens", "the stream ended without a text chunk")
    out.ok = True
    return out


def _failed(out: Outcome, kind: str, message: str) -> Outcome:
    out.ok, out.error_kind, out.error = False, kind, message
    return out


@dataclass(frozen=True)
class Scenario:
    """closed: `concurrency` clients, each sending its next request when the last one ends;
    poisson: requests arriving at `rate` per second; burst: all requests sent at once."""
    kind: str                 # "closed", "poisson" or "burst"
    requests: int
    concurrency: int = 1
    rate: float = 0.0

    @property
    def name(self) -> str:
        if self.kind == "closed":
            return f"closed c={self.concurrency}"
        if self.kind == "poisson":
            return f"poisson {self.rate:g}/s"
        return f"burst {self.requests}"


async def drive(base: str, scenario: Scenario, specs: list[RequestSpec], chat: bool = False,
                temperature: float = 0.0, model: str | None = None, timeout: float = 600.0,
                seed: int = 0) -> tuple[list[Outcome], float]:
    """Run the scenario's requests against an OpenAI-compatible server at `base`: the outcomes (in
    the order of `specs`) and the seconds from the first request sent to the last one ended."""
    import aiohttp
    url = base.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    payloads = [body(s, chat, temperature, model) for s in specs[:scenario.requests]]
    outcomes: list[Outcome | None] = [None] * len(payloads)
    # a connection per request: a kept-alive one that the server closed between two requests would
    # fail the next request for a reason of the client's own
    connector = aiohttp.TCPConnector(limit=0, force_close=True)

    async with aiohttp.ClientSession(connector=connector) as session:
        async def send(i: int) -> None:
            outcomes[i] = await one_request(session, url, payloads[i], chat, timeout)

        t0 = time.perf_counter()
        if scenario.kind == "closed":
            queue = iter(range(len(payloads)))

            async def client() -> None:
                for i in queue:
                    await send(i)
            await asyncio.gather(*(client() for _ in range(scenario.concurrency)))
        elif scenario.kind == "poisson":
            rnd, tasks, at = random.Random(seed), [], 0.0
            for i in range(len(payloads)):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                tasks.append(asyncio.create_task(send(i)))
                at += rnd.expovariate(scenario.rate)
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(send(i) for i in range(len(payloads))))
        return [o for o in outcomes if o is not None], time.perf_counter() - t0


def summarize(outcomes: list[Outcome], seconds: float) -> dict:
    """The figures of one scenario on one server."""
    good = [o for o in outcomes if o.ok]
    errors: dict[str, dict] = {}
    for o in outcomes:
        if not o.ok:
            e = errors.setdefault(o.error_kind, {"count": 0, "first": o.error})
            e["count"] += 1
    ttft = [o.ttft for o in good]
    gaps = [g for o in good for g in o.gaps]
    tokens = sum(o.tokens for o in good)
    prompt = [o.prompt_tokens for o in good if o.prompt_tokens is not None]
    r = {"requests": len(outcomes), "ok": len(good), "failed": len(outcomes) - len(good),
         "short": sum(o.tokens < o.asked for o in good), "errors": errors, "seconds": seconds,
         "requests_per_s": len(good) / seconds if seconds > 0 else math.nan,
         "output_tokens": tokens, "output_tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
         "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else math.nan}
    for q in (50, 90, 99):
        r[f"ttft_p{q}"] = percentile(ttft, q)
        r[f"itl_p{q}"] = percentile(gaps, q)
    return r


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


COLUMNS = ("server", "scenario", "ok", "failed", "short", "req/s", "out tok/s",
           "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms")


def table_rows(results: list[dict]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        rows.append((r["server"], r["scenario"], str(r["ok"]), str(r["failed"]), str(r["short"]),
                     f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                     "/".join(_ms(r[f"ttft_p{q}"]) for q in (50, 90, 99)),
                     "/".join(_ms(r[f"itl_p{q}"]) for q in (50, 90, 99))))
    return rows


def render_table(results: list[dict]) -> str:
    """A plain-text table of the results, then the first error of each kind per row."""
    rows = [COLUMNS, *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        for kind, e in r["errors"].items():
            lines.append(f"{r['server']} {r['scenario']}: {e['count']} x {kind}: {e['first']}")
    return "\n".join(lines)
