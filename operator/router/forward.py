"""Relaying one request to a replica: a whole answer (sent again to another replica when the first
fails before answering), or a stream that moves to another replica when its own fails mid-stream
(migration.py decides what the continuation asks for).

A replica has failed when the connection fails or is reset, when it answers 5xx before the first
byte of a stream, when a stream ends (EOF) before [DONE], or when it sends an error object or a
chunk that does not parse. A failed connection marks the replica down until its health check
passes. A request tries at most `max_attempts` replicas; it fails only when none can take it.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

import aiohttp
from aiohttp import web

from shardwise.operator.router.migration import Event, StreamState, migratable, with_token_ids

__all__ = ["migratable", "passthrough", "stream", "whole"]

MAX_ANSWER_BYTES = 64 * 1024 * 1024     # a whole (not streamed) answer read from a replica
MAX_EVENT_BYTES = 4 * 1024 * 1024       # one SSE event from a replica
PASSED_HEADERS = ("Retry-After", "WWW-Authenticate")
FAILED = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError)


def upstream_headers(request: web.Request) -> dict:
    """What a replica is sent of the client's headers: its key (the replica checks it too) only."""
    h = {"Content-Type": "application/json"}
    if "Authorization" in request.headers:
        h["Authorization"] = request.headers["Authorization"]
    return h


async def replicas_to_try(router, hashes: list[bytes], t0: float | None) -> AsyncIterator:
    """The replica of each attempt, at most max_attempts, each counted as routed; the time from the
    request's arrival to its first forwarding observed once. Ends when no replica is Ready."""
    for attempt in range(router.settings.max_attempts):
        replica = await router.pick(hashes)
        if replica is None:
            return
        router.routed(replica, hashes)
        if attempt == 0 and t0 is not None:
            router.metrics.added.observe(time.perf_counter() - t0)
        yield replica


async def whole(router, request: web.Request, path: str, body: dict | None, hashes: list[bytes],
                t0: float | None = None) -> tuple[web.Response, int]:
    """A request answered in one piece (or GET /v1/models): (the response, tokens generated)."""
    last: web.Response | None = None
    async for replica in replicas_to_try(router, hashes, t0):
        replica.running += 1
        try:
            if body is None:
                call = router.session.get(replica.address + path, headers=upstream_headers(request))
            else:
                call = router.session.post(replica.address + path, data=json.dumps(body).encode(),
                                           headers=upstream_headers(request))
            async with call as up:
                data = await up.content.read(MAX_ANSWER_BYTES + 1)
                if len(data) > MAX_ANSWER_BYTES:
                    raise ValueError("answer too large")
                status, ctype = up.status, up.headers.get("Content-Type", "application/json")
                headers = {k: up.headers[k] for k in PASSED_HEADERS if k in up.headers}
        except FAILED as e:
            failed(router, replica, e)
            continue
        finally:
            replica.running -= 1
        resp = web.Response(status=status, body=data, headers={**headers, "Content-Type": ctype})
        if status >= 500:
            router.metrics.upstream_errors.labels(kind=f"http_{status}").inc()
            router.replicas.mark_down(replica)
            last = resp
            router.metrics.retries.inc()
            continue
        return resp, completion_tokens(data) if status == 200 else 0
    return last or router.unavailable(), 0


async def passthrough(router, request: web.Request, path: str, body: dict, hashes: list[bytes],
                      t0: float) -> web.StreamResponse:
    """A stream that cannot move (several choices): relayed byte for byte, sent again to another
    replica only when its replica fails before answering."""
    client = Client(request)
    payload = json.dumps(body).encode()
    async for replica in replicas_to_try(router, hashes, t0):
        replica.running += 1
        try:
            async with router.session.post(replica.address + path, data=payload,
                                           headers=upstream_headers(request)) as up:
                if up.status >= 500:
                    raise aiohttp.ClientResponseError(up.request_info, (), status=up.status)
                if up.status != 200:
                    data = await up.content.read(MAX_ANSWER_BYTES)
                    return web.Response(status=up.status, body=data, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json")})
                async for got in up.content.iter_any():
                    await client.send(got)
                return client.resp
        except FAILED as e:
            if client.gone or client.resp is not None:
                return client.resp      # bytes were given: this stream cannot start again
            failed(router, replica, e)
        finally:
            replica.running -= 1
    return client.resp or router.unavailable()


def completion_tokens(data: bytes) -> int:
    try:
        n = json.loads(data).get("usage", {}).get("completion_tokens", 0)
    except (ValueError, AttributeError):
        return 0
    return n if isinstance(n, int) else 0


def failed(router, replica, e: BaseException) -> None:
    kind = "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
    router.metrics.upstream_errors.labels(kind=kind).inc()
    router.replicas.mark_down(replica)


class Client:
    """The client's side of a stream: opened on the first chunk, written event by event."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.gone = False

    async def open(self) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                                "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)

    async def finish(self, payload: bytes) -> None:
        """The last events and the end of the response in one write (one system call)."""
        await self._write(payload, last=True)

    async def send(self, payload: bytes) -> None:
        await self._write(payload, last=False)

    async def _write(self, payload: bytes, last: bool) -> None:
        """Write to the client; a client gone is remembered (nothing more is sent) and raised."""
        await self.open()
        try:
            await (self.resp.write_eof(payload) if last else self.resp.write(payload))
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            self.gone = True
            raise


async def stream(router, request: web.Request, path: str, body: dict, hashes: list[bytes],
                 t0: float) -> tuple[web.StreamResponse, int]:
    """A streamed request of one choice, moved to another replica whenever its replica fails."""
    state = StreamState.of(body, chat=path.endswith("/chat/completions"))
    client = Client(request)
    target, payload = path, with_token_ids(body)
    async for replica in replicas_to_try(router, hashes, t0):
        outcome = await relay(router, request, replica, target, payload, state, client)
        if outcome is not None:
            return outcome, len(state.generated)
        if client.gone:
            return client.resp, len(state.generated)
        nxt = state.continuation(body)
        if nxt is not None:
            target, payload = "/v1/completions", nxt
            state.moved()
            router.metrics.migrations.inc()
        elif state.finished or (state.can_continue and client.resp is not None):
            # nothing left to generate: end the stream as the replica would have
            for chunk in ([] if state.finished else state.closing()):
                await client.send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await client.send(b"data: [DONE]\n\n")
            return client.resp, len(state.generated)
        elif client.resp is not None:
            break                   # a replica without token ids: this stream cannot move
        else:
            router.metrics.retries.inc()
    if client.resp is None:
        return router.unavailable(), 0
    err = {"error": {"message": "the replicas serving this stream failed and no other could continue it",
                     "type": "server_error", "param": None, "code": "upstream_failed"}}
    await client.send(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
    return client.resp, len(state.generated)


async def relay(router, request, replica, path: str, payload: dict, state: StreamState,
                client: Client) -> web.StreamResponse | None:
    """One replica's part of a stream. Returns the client's response when the stream is complete
    or the replica refused it with a 4xx before any byte (passed on as is), None when it failed."""
    replica.running += 1
    try:
        async with router.session.post(replica.address + path, data=json.dumps(payload).encode(),
                                       headers=upstream_headers(request)) as up:
            if up.status != 200:
                data = await up.content.read(MAX_ANSWER_BYTES)
                if up.status < 500 and client.resp is None:
                    headers = {k: up.headers[k] for k in PASSED_HEADERS if k in up.headers}
                    return web.Response(status=up.status, body=data, headers={
                        **headers, "Content-Type": up.headers.get("Content-Type", "application/json")})
                raise aiohttp.ClientResponseError(up.request_info, (), status=up.status)
            return await events(up, state, client)
    except FAILED as e:
        if client.gone:
            return None
        failed(router, replica, e)
        return None
    finally:
        replica.running -= 1


async def events(up: aiohttp.ClientResponse, state: StreamState, client: Client) -> web.StreamResponse | None:
    """The replica's events passed on (rewritten by `state`) until [DONE]; None when it failed.
    What arrives in one read is passed on in one write (a replica that sends several tokens at
    once costs one system call here, not one per token)."""
    buf = b""
    while True:
        got = await up.content.readany()
        if not got:
            return None                 # EOF before [DONE]
        buf += got
        if len(buf) > MAX_EVENT_BYTES:
            return None
        *complete, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
        out = []
        for raw in complete:
            data = b"".join(line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:"))
            # one data line is the rule; several are joined, as SSE says
            if not data:
                continue
            event, obj = state.feed(data)
            if event == Event.FAILED:
                break
            if event == Event.DONE:
                out.append(b"data: [DONE]\n\n")
                await client.finish(b"".join(out))
                return client.resp
            if event == Event.CHUNK:
                out.append(b"data: " + obj + b"\n\n")
        else:
            if out:
                await client.send(b"".join(out))
            continue
        if out:
            await client.send(b"".join(out))
        return None
