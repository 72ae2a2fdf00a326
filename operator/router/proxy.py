"""The router's HTTP server (aiohttp): its endpoints, API keys, per-key rate limits, the hold while
no replica is Ready, and the choice of a replica for each request (forward.py relays it).

Nothing a client sends is trusted: the body is bounded (client_max_size), so are the request line,
each header and their count; a body that is not a JSON object is refused here, anything else is
the replica's to validate. Requests are held at most `hold_seconds`, at most `max_held` at once.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shardwise.crds.apikeys import ApiKeys
from shardwise.crds.router import HOLD_SECONDS
from shardwise.operator.router import forward
from shardwise.operator.router.limits import Buckets, RateLimit
from shardwise.operator.router.metrics import Metrics
from shardwise.operator.router.replicas import ReplicaSet
from shardwise.operator.router.routing import Policy, Replica, block_hashes, choose, prompt_text

COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"


@dataclass
class Settings:
    policy: Policy = Policy.PREFIX
    hold_seconds: float = HOLD_SECONDS  # how long a request waits for a Ready replica
    max_held: int = 1024                # requests waiting at once; more are answered 503 at once
    max_body: int = 4 * 1024 * 1024     # bytes of a request body
    max_headers: int = 64               # headers of a request
    max_attempts: int = 4               # replicas one request is sent to, migrations included
    connect_timeout: float = 2.0        # seconds to connect to a replica
    read_timeout: float = 300.0         # seconds a replica may stay silent (prefill, a whole answer)
    check_interval: float = 1.0         # seconds between health checks
    pool_size: int = 1024               # connections to the replicas, all together
    pool_per_replica: int = 256


def error_response(status: int, message: str, code: str | None = None, retry_after: float | None = None,
                   kind: str | None = None) -> web.Response:
    """OpenAI's error shape; Retry-After in whole seconds, at least 1."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


class Router:
    """State the handlers share: replicas, keys, limits, metrics, the client session."""

    def __init__(self, replicas: ReplicaSet, settings: Settings, keys: ApiKeys | None = None,
                 limit: RateLimit | None = None):
        self.replicas, self.settings, self.keys = replicas, settings, keys
        self.buckets = Buckets(limit) if limit else None
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self.held = 0
        self.turn = 0
        self._checks: asyncio.Task | None = None

    # ---- lifecycle ----
    async def start(self, app: web.Application) -> None:
        s = self.settings
        connector = aiohttp.TCPConnector(limit=s.pool_size, limit_per_host=s.pool_per_replica,
                                         keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, connect=s.connect_timeout, sock_read=s.read_timeout))
        self.replicas.reload()
        await self.replicas.check(self.session)
        self._checks = asyncio.create_task(self.replicas.run(self.session))

    async def stop(self, app: web.Application) -> None:
        if self._checks:
            self._checks.cancel()
        if self.session:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get(MODELS, self.models)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT, self.completions)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # ---- open endpoints ----
    async def healthz(self, request: web.Request) -> web.Response:
        # the router is alive whether or not a replica is Ready: it holds requests meanwhile
        ready = sum(r.ready for r in self.replicas.replicas)
        return web.json_response({"status": "ok", "ready_replicas": ready, "replicas": len(self.replicas.replicas)})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.ready.set(sum(r.ready for r in self.replicas.replicas))
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- admission ----
    def admit(self, request: web.Request) -> tuple[web.Response | None, int]:
        """(the refusal of a request, or None; the index of its key, -1 without keys)."""
        key = -1
        if self.keys is not None:
            why, key = self.keys.identify(request.headers.get("Authorization"))
            if why:
                return error_response(401, why, "invalid_api_key"), key
        if self.buckets is not None:
            wait = self.buckets.take(key, time.monotonic())
            if wait > 0:
                self.metrics.rate_limited.inc()
                return error_response(429, "Rate limit reached for this API key; retry after the time in "
                                           "the Retry-After header.", "rate_limit_exceeded", retry_after=wait), key
        return None, key

    def charge(self, key: int, tokens: int) -> None:
        if self.buckets is not None:
            self.buckets.charge(key, tokens, time.monotonic())

    async def pick(self, hashes: list[bytes]) -> Replica | None:
        """The replica for a request, holding it while none is Ready (bounded in time and count)."""
        self.turn += 1
        r = choose(self.replicas.replicas, hashes, self.settings.policy, self.turn)
        if r is not None or self.held >= self.settings.max_held:
            return r
        self.held += 1
        self.metrics.holds.inc()
        self.metrics.held.inc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.hold_seconds
        try:
            while r is None:
                left = deadline - loop.time()
                if left <= 0:
                    self.metrics.hold_timeouts.inc()
                    return None
                try:
                    await asyncio.wait_for(self.replicas.changed.wait(), min(left, self.settings.check_interval))
                except asyncio.TimeoutError:
                    pass
                r = choose(self.replicas.replicas, hashes, self.settings.policy, self.turn)
            return r
        finally:
            self.held -= 1
            self.metrics.held.dec()

    def unavailable(self) -> web.Response:
        return error_response(503, "No replica of this model is ready; retry after the time in the "
                                   "Retry-After header.", "no_replica_ready",
                              retry_after=max(1.0, self.settings.check_interval * 5))

    def routed(self, replica: Replica, hashes: list[bytes]) -> None:
        self.metrics.routed.labels(replica=replica.address).inc()
        self.metrics.prefix_blocks.inc(replica.index.matched(hashes))
        replica.index.add(hashes)

    # ---- the API ----
    async def models(self, request: web.Request) -> web.StreamResponse:
        refusal, _ = self.admit(request)
        if refusal is not None:
            return self.count(MODELS, refusal)
        return self.count(MODELS, (await forward.whole(self, request, MODELS, None, []))[0])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = request.path
        refusal, key = self.admit(request)
        if refusal is not None:
            return self.count(path, refusal)
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return self.count(path, error_response(413, f"request body larger than {self.settings.max_body} bytes"))
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return self.count(path, error_response(400, "the request body must be a JSON object"))
        hashes = block_hashes(prompt_text(body, path == CHAT))
        if forward.migratable(body):
            resp, tokens = await forward.stream(self, request, path, body, hashes, t0)
        elif body.get("stream") is True:
            resp, tokens = await forward.passthrough(self, request, path, body, hashes, t0), 0
        else:
            resp, tokens = await forward.whole(self, request, path, body, hashes, t0)
        self.charge(key, tokens)
        return self.count(path, resp)

    def count(self, path: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(endpoint=path, code=str(resp.status)).inc()
        return resp
