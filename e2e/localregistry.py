"""The distribution registry (the binary the kind suite builds, shardwise.e2e.build) run as a local
process on a loopback port with a temporary storage root: the real registry `oci://` models are
pushed to and pulled from in the tests and the benchmark.

`LocalRegistry(root)` serves anonymously; `users={"name": "password"}` turns on the registry's
htpasswd auth (a `Basic` challenge), and with `bearer=True` its token auth instead, with a local
token service (shardwise.e2e.tokenauth) checking those users (a `Bearer` challenge). Use it as `with LocalRegistry(tmp) as reg:`; `reg.host` is
`127.0.0.1:<port>`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from shardwise.e2e import build, processes
from shardwise.e2e.tokenauth import TokenService

START_TIMEOUT_S = 30.0


def binary() -> Path | None:
    """The built registry binary, or None when `shardwise kind build` has not built it."""
    path = build.bin_dir() / "registry"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# bcrypt's lowest cost (2^4 rounds): the registry checks the password with bcrypt on every request,
# and at the default cost (2^12) a pull of a few files spent seconds hashing on a loaded machine.
BCRYPT_ROUNDS = 16


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash (the only kind the registry's htpasswd accepts) from the C library's crypt(3),
    through the standard library's `crypt` (deprecated, still there up to Python 3.12)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=BCRYPT_ROUNDS))


class LocalRegistry:
    def __init__(self, root: Path, users: dict[str, str] | None = None, bearer: bool = False):
        self.root = Path(root)
        self.users = users or {}
        self.bearer = bearer
        self.tokens: TokenService | None = None
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = self.root / "storage"
        self._proc: subprocess.Popen | None = None

    def _config(self) -> str:
        auth = ""
        if self.bearer:
            self.tokens = TokenService(self.root, self.users)
            auth = self.tokens.registry_auth()
        elif self.users:
            htpasswd = self.root / "htpasswd"
            htpasswd.write_text("".join(
                f"{u}:{bcrypt_hash(p)}\n" for u, p in self.users.items()))
            auth = f"auth:\n  htpasswd: {{realm: shardwise-test, path: {htpasswd}}}\n"
        return (f"version: 0.1\nlog: {{level: error}}\n"
                f"storage:\n  filesystem: {{rootdirectory: {self.storage}}}\n  delete: {{enabled: true}}\n"
                f"http: {{addr: \"{self.host}\"}}\n{auth}")

    def __enter__(self) -> "LocalRegistry":
        exe = binary()
        if exe is None:
            raise FileNotFoundError("the registry binary is not built (shardwise kind build)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(self._config())
        log = open(self.root / "registry.log", "wb")
        self._proc = subprocess.Popen([str(exe), "serve", str(config)], stdout=log, stderr=log,
                                      stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the registry did not start; see {self.root / 'registry.log'}")
            time.sleep(0.1)
        return self

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True        # 401 with auth on: it is up
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.tokens is not None:
            self.tokens.close()
        if self._proc is not None:
            processes.stop(self._proc, 10)

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (its filesystem driver's layout)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
