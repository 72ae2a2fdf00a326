"""`shardwise router`: a model's front door in front of its replicas.

    shardwise router --replicas http://10.0.0.5:8000,http://10.0.0.6:8000 --port 8080 \\
        [--replicas-file FILE] [--api-key-file KEYS] [--rate-limit 5/s]

Replicas come from --replicas, or from --replicas-file (one address per line or comma-separated,
re-read when it changes: a file rendered from a ConfigMap or the Endpoints), or both (the file wins
once it can be read).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from shardwise.crds import names
from shardwise.crds.apikeys import KeyFileError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shardwise.operator.router.proxy import Settings
    from shardwise.operator.router.routing import Policy
    d = Settings()
    parser.add_argument("--replicas", default="", help="the replicas' base URLs, comma-separated")
    parser.add_argument("--replicas-file", help="a file of replica URLs (one per line), re-read when it changes")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: $POD_IP when it is a loopback address, else 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    parser.add_argument("--api-key-file", help="the model's API keys (one per line, the worker's format)")
    parser.add_argument("--rate-limit", help="per-key limit RATE/s[:BURST][:requests|tokens], e.g. 5/s "
                                             "or 200/s:1000:tokens (tokens: generated tokens)")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default=d.policy.value,
                        help="prefix: longest cached prefix against load; round-robin: for comparison")
    parser.add_argument("--hold-seconds", type=float, default=d.hold_seconds,
                        help="how long a request waits while no replica is Ready, then 503")
    parser.add_argument("--max-held", type=int, default=d.max_held, help="requests held at once")
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts,
                        help="replicas one request may be sent to (migrations included)")
    parser.add_argument("--read-timeout", type=float, default=d.read_timeout,
                        help="seconds a replica may stay silent before it counts as failed")
    parser.add_argument("--check-interval", type=float, default=d.check_interval,
                        help="seconds between health checks of the replicas")


def _settings(args):
    from shardwise.operator.router.proxy import Settings
    from shardwise.operator.router.routing import Policy
    for name in ("hold_seconds", "read_timeout", "check_interval"):
        v = getattr(args, name)
        if not 0 <= v <= 3600:
            raise ValueError(f"--{name.replace('_', '-')} {v}: expected 0 to 3600 seconds")
    for name in ("max_held", "max_attempts"):
        if not 1 <= getattr(args, name) <= 100000:
            raise ValueError(f"--{name.replace('_', '-')}: expected 1 to 100000")
    return Settings(policy=Policy(args.policy), hold_seconds=args.hold_seconds, max_held=args.max_held,
                    max_attempts=args.max_attempts, read_timeout=args.read_timeout,
                    check_interval=max(0.05, args.check_interval))


def run(args) -> int:
    from shardwise.crds.apikeys import ApiKeys
    from shardwise.operator.router.limits import RateLimit
    from shardwise.operator.router.proxy import Router
    from shardwise.operator.router.replicas import ReplicaSet, parse_addresses
    try:
        addresses = parse_addresses(args.replicas)
        if not addresses and not args.replicas_file:
            raise ValueError("give the replicas: --replicas URL[,URL...] or --replicas-file FILE")
        settings = _settings(args)
        keys = ApiKeys.from_file(args.api_key_file) if args.api_key_file else None
        limit = RateLimit.parse(args.rate_limit) if args.rate_limit else None
    except (ValueError, KeyFileError) as e:
        print(f"shardwise router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="shardwise router: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    replicas = ReplicaSet(addresses, args.replicas_file, settings.check_interval)
    router = Router(replicas, settings, keys, limit)
    host = args.host or names.bind_address(os.environ.get(names.ENV_POD_IP, ""))
    try:
        asyncio.run(_serve(router, host, args.port, settings))
    except OSError as e:
        print(f"shardwise router: cannot listen on {host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


async def _serve(router, host: str, port: int, settings) -> None:
    from aiohttp import web
    runner = web.AppRunner(router.app(), access_log=None, max_headers=settings.max_headers,
                           max_line_size=8190, max_field_size=8190)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    print(f"shardwise router: listening on http://{shown}:{bound[1]} in front of "
          f"{len(router.replicas.replicas)} replicas", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
