"""The router's added time to first token and its streamed throughput, against a stub backend.

    nice -n 19 python benchmarks/router_bench.py [--tokens 16] [--requests 400] [--concurrency 64]
                                                 [--seconds 5] [--rounds 3] [--json]

The stub (this file with --stub, an aiohttp server written for the benchmark) answers
/v1/completions with a stream of N tokens at once, token ids included as a shardwise replica
gives them, and /healthz. The router (`shardwise router`, its own process) sits in front of it.
Direct and routed runs alternate in rounds (the machine is shared: both see the same drift), and
the best round of each is reported:
- TTFT: sequential requests, time from sending to the first chunk; p50 and p99, and the router's
  added time (routed - direct);
- throughput: `--concurrency` clients streaming whole answers for `--seconds`; requests/s.
Processes: stub, router and client each run in their own process; on a 2-core machine they share
the cores, so the figures are a lower bound for a router with its own cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stub_main(port: int, tokens: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = body.get("return_token_ids") is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub"}
        for i in range(tokens):
            choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}
            obj = {**head, "choices": [choice]}
            if ids:
                choice["token_ids"] = [i]
                if i == 0:
                    obj.update(prompt_token_ids=[1, 2, 3], max_tokens=tokens)
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        fin = {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(fin).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def healthz(request):
        return web.Response(text="ok")
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/healthz", healthz)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(session, url: str) -> float:
    """Seconds to the first chunk of one streamed request (the whole stream is read)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url, json={"prompt": "the quick brown fox", "max_tokens": 16, "stream": True}) as r:
        async for line in r.content:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - t0
            if line.startswith(b"data: [DONE]"):
                break
    assert first is not None and r.status == 200
    return first


async def ttft(session, url: str, n: int) -> list[float]:
    for _ in range(10):         # warm the connections
        await _one(session, url)
    return [await _one(session, url) for _ in range(n)]


async def throughput(session, url: str, concurrency: int, seconds: float) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def client():
        nonlocal done
        while time.perf_counter() < end:
            await _one(session, url)
            done += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _throughput_process(url: str, concurrency: int, seconds: float) -> float:
    import aiohttp

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2)) as session:
            return await throughput(session, url, concurrency, seconds)
    return asyncio.run(go())


def throughput_clients(url: str, args) -> float:
    """Streams/s of `--clients` client processes together (one Python client is slower than the router)."""
    from concurrent.futures import ProcessPoolExecutor
    per = max(1, args.concurrency // args.clients)
    with ProcessPoolExecutor(args.clients) as pool:
        return sum(pool.map(_throughput_process, [url] * args.clients, [per] * args.clients,
                            [args.seconds] * args.clients))


async def measure(args, direct: str, routed: str, router_pid: int) -> dict:
    import aiohttp
    out: dict = {"direct": {"p50": [], "p99": [], "rps": []}, "router": {"p50": [], "p99": [], "rps": []}}
    cpu_ms = []         # the router's CPU per stream in its throughput rounds: a figure the load moves less
    conn = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(args.rounds):
            for name, url in (("direct", direct), ("router", routed)):
                xs = await ttft(session, url, args.requests)
                out[name]["p50"].append(pct(xs, 0.5))
                out[name]["p99"].append(pct(xs, 0.99))
                c0, t0 = cpu_seconds(router_pid), time.perf_counter()
                rps = await asyncio.get_running_loop().run_in_executor(None, throughput_clients, url, args)
                out[name]["rps"].append(rps)
                if name == "router":
                    cpu_ms.append((cpu_seconds(router_pid) - c0) * 1e3 / (rps * (time.perf_counter() - t0)))
    best = {n: {"ttft_p50_ms": min(v["p50"]) * 1e3, "ttft_p99_ms": min(v["p99"]) * 1e3, "streams_per_s": max(v["rps"])}
            for n, v in out.items()}
    d, r = best["direct"], best["router"]
    best["added"] = {"ttft_p50_ms": r["ttft_p50_ms"] - d["ttft_p50_ms"], "ttft_p99_ms": r["ttft_p99_ms"] - d["ttft_p99_ms"]}
    best["ratio_router_over_direct"] = {k: r[k] / d[k] for k in d}
    # the router is one process on one event loop: one core's worth of streams at this CPU cost
    best["router_cpu_ms_per_stream"] = min(cpu_ms)
    best["router_streams_per_core_s"] = 1e3 / min(cpu_ms)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stub", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=16, help="tokens per streamed answer")
    p.add_argument("--requests", type=int, default=400, help="sequential requests per TTFT round")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=2, help="client processes of the throughput rounds")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", help="run the router under cProfile, writing its statistics to this file")
    args = p.parse_args()
    if args.stub:
        stub_main(args.stub, args.tokens)
        return 0
    port = _free_port()
    stub = subprocess.Popen([sys.executable, __file__, "--stub", str(port), "--tokens", str(args.tokens)])
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    router = subprocess.Popen([sys.executable, *prof, "-m", "shardwise", "router", "--replicas", f"http://127.0.0.1:{port}",
                               "--port", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        base = None
        for line in router.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                base = m.group(1)
                break
        assert base, "the router did not start"
        time.sleep(1.5)
        best = asyncio.run(measure(args, f"http://127.0.0.1:{port}/v1/completions", base + "/v1/completions",
                                   router.pid))
    finally:
        for proc in (router, stub):
            proc.terminate()
            proc.wait(10)
    d, r = best["direct"], best["router"]
    print(f"{args.tokens} tokens per stream, {args.concurrency} concurrent streams from {args.clients} client "
          f"processes, best of {args.rounds} rounds")
    print(f"TTFT p50: direct {d['ttft_p50_ms']:.3f} ms, router {r['ttft_p50_ms']:.3f} ms (+{best['added']['ttft_p50_ms']:.3f} ms)")
    print(f"TTFT p99: direct {d['ttft_p99_ms']:.3f} ms, router {r['ttft_p99_ms']:.3f} ms (+{best['added']['ttft_p99_ms']:.3f} ms)")
    print(f"streams/s: direct {d['streams_per_s']:.0f}, router {r['streams_per_s']:.0f} "
          f"(ratio {best['ratio_router_over_direct']['streams_per_s']:.2f})")
    print(f"router CPU per stream: {best['router_cpu_ms_per_stream']:.3f} ms, i.e. "
          f"{best['router_streams_per_core_s']:.0f} streams/s per core it has to itself")
    if args.json:
        print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
