"""The replica set: which replicas there are (from flags, or a file re-read when it changes) and
which are Ready (active health checks of /healthz, and a failed connection marks one down at once
until its check passes again)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from urllib.parse import urlsplit

import aiohttp

from shardwise.operator.router.routing import Replica

log = logging.getLogger("shardwise.router")

MAX_REPLICAS = 256          # addresses taken from flags or the file
MAX_FILE_BYTES = 64 * 1024  # the replicas file
CHECK_TIMEOUT = 2.0         # seconds a /healthz check may take
MAX_HEALTH_BYTES = 4096     # of a /healthz answer read
MAX_REPORTED = 1 << 20      # a replica's reported running or waiting count believed at most


def reported_load(body: bytes) -> tuple[int, int]:
    """(running, waiting) from a replica's /healthz answer; 0 for what is missing or absurd."""
    try:
        obj = json.loads(body)
    except ValueError:
        return 0, 0
    if not isinstance(obj, dict):
        return 0, 0

    def count(key: str) -> int:
        v = obj.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_REPORTED else 0
    return count("running"), count("waiting")


def parse_addresses(text: str) -> list[str]:
    """Base URLs from a comma- or line-separated list (`#` starts a comment). ValueError: one line."""
    out: list[str] = []
    for raw in text.replace(",", "\n").splitlines():
        item = raw.split("#", 1)[0].strip().rstrip("/")
        if not item:
            continue
        if "://" not in item:
            item = "http://" + item
        u = urlsplit(item)
        try:
            u.port
        except ValueError:
            u = None
        if u is None or u.scheme not in ("http", "https") or not u.hostname or u.path or u.query:
            raise ValueError(f"replica address {item!r}: expected http://host:port")
        if item not in out:
            out.append(item)
    if len(out) > MAX_REPLICAS:
        raise ValueError(f"{len(out)} replica addresses; at most {MAX_REPLICAS}")
    return out


class ReplicaSet:
    """The replicas and their readiness. The file, when given, replaces the list whenever its
    modification time changes; a replica kept across a change keeps its state and prefix index."""

    def __init__(self, addresses: list[str], file: str | None = None, interval: float = 1.0):
        self.replicas = [Replica(a) for a in addresses]
        self.file, self.interval = file, interval
        self._mtime: float | None = None
        self.changed = asyncio.Event()      # set when a replica becomes Ready (held requests wake)

    def by_address(self, address: str) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def reload(self) -> None:
        """Re-read the file if it changed; a file that cannot be read or parsed keeps the old list."""
        if not self.file:
            return
        try:
            st = os.stat(self.file)
            if st.st_mtime == self._mtime:
                return
            if st.st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            with open(self.file, encoding="utf-8") as f:
                addresses = parse_addresses(f.read())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.warning("replicas file %s: %s; keeping %d replicas", self.file, e, len(self.replicas))
            return
        self._mtime = st.st_mtime
        old = {r.address: r for r in self.replicas}
        self.replicas = [old.get(a) or Replica(a) for a in addresses]
        log.info("replicas file %s: %d replicas", self.file, len(self.replicas))

    def mark_down(self, replica: Replica) -> None:
        """A failed connection: no new request goes there until its health check passes."""
        replica.ready = False

    async def check(self, session: aiohttp.ClientSession) -> None:
        self.reload()
        results = await asyncio.gather(*(self._check_one(session, r) for r in self.replicas))
        if any(results):
            self.changed.set()
            self.changed = asyncio.Event()

    async def _check_one(self, session: aiohttp.ClientSession, r: Replica) -> bool:
        """Check one replica; True when it became Ready."""
        try:
            async with session.get(r.address + "/healthz", timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT)) as resp:
                ok = resp.status == 200
                body = await resp.content.read(MAX_HEALTH_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok, body = False, b""
        r.reported_running, r.waiting = reported_load(body) if ok else (0, 0)
        became = ok and not r.ready
        r.ready = ok
        return became

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.check(session)
            except Exception as e:  # noqa: BLE001 - the checks must go on whatever one pass met
                log.warning("health checks: %s: %s", type(e).__name__, e)
            await asyncio.sleep(self.interval)
