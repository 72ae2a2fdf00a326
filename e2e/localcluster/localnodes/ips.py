"""Pod IPs: each pod of a local node gets a loopback address of its own."""
from __future__ import annotations

import hashlib
import threading


class IPPool:
    """Loopback addresses for pods, 127.X.Y.1-254 with X.Y taken from the state folder, so that two
    local clusters on one machine rarely share addresses."""

    def __init__(self, seed: str):
        digest = hashlib.sha256(seed.encode()).digest()
        self.base = (digest[0] % 250 + 2, digest[1])
        self.used: set[str] = set()
        self.lock = threading.Lock()

    def take(self, wanted: str | None = None) -> str:
        """A free address; `wanted` (the pod's earlier IP, after a runtime or node restart) if free."""
        with self.lock:
            if wanted and wanted.startswith("127.") and wanted != "127.0.0.1" \
                    and wanted not in self.used:
                self.used.add(wanted)
                return wanted
            x, y = self.base
            for i in range(254 * 16):
                ip = f"127.{x}.{(y + i // 254) % 256}.{i % 254 + 1}"
                if ip not in self.used:
                    self.used.add(ip)
                    return ip
        raise RuntimeError("no free loopback address for a pod")

    def give_back(self, ip: str) -> None:
        with self.lock:
            self.used.discard(ip)
