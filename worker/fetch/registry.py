"""A client of one repository of an OCI registry over the distribution API, with its auth.

What `oci://` pulls and what the pusher uploads both go through here: manifests by tag or digest
(bounded in size, their digest computed from the bytes), blobs by digest with byte ranges, blob
uploads and manifest puts. Authentication follows the registry's `WWW-Authenticate` challenge:
`Basic` sends the username and password; `Bearer` asks the realm it names for a token scoped to
this repository (with the username and password when given, anonymously otherwise, as Docker Hub,
GHCR, Harbor and the distribution registry's token auth expect), and retries once with it.

HTTPS unless the caller asks for plain HTTP: the stores do for a loopback registry, and for one the
operator's --plain-http-registry lists (a cluster admin's choice, worker/fetch/stores.py); `shardwise
push --plain-http` when its user says so. A token service is asked over plain HTTP only where the
registry itself is. Neither credentials nor tokens are logged or put in a message.
"""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from contextlib import contextmanager
from typing import Iterator

import httpx2

from shardwise.crds import boundedjson
from shardwise.worker.fetch.ranged import read_bounded
from shardwise.worker.fetch.remote import NotFound, RemoteError, Unauthorized, Unreachable, busy

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
# The distribution registry refuses manifests above 4 MiB; nothing larger is read.
MAX_MANIFEST_BYTES = 4 << 20
# A token endpoint's answer is a few KiB of JSON.
MAX_TOKEN_BYTES = 64 << 10
# An error body is read only this far, for its registry error code.
MAX_ERROR_BYTES = 16 << 10
REQUEST_TIMEOUT_S = 60.0
DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_JSON_DEPTH = 8              # a token answer or an error body nests 3 deep
_PARAM = re.compile(r'(\w+)="([^"]*)"')


def is_loopback(host: str) -> bool:
    """Whether `host[:port]` (an IPv6 address in brackets) names this machine."""
    if host.startswith("["):
        name = host[1:host.find("]")]
    else:
        name = host.split(":")[0] if host.count(":") == 1 else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Registry:
    """One repository (`host[:port]/name`) of a registry, authenticated as the constructor says."""

    def __init__(self, host: str, repository: str, plain_http: bool = False,
                 username: str | None = None, password: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S):
        self.host, self.repository, self.plain_http = host, repository, plain_http
        self.base = f"{'http' if plain_http else 'https'}://{host}/v2/{repository}"
        self._basic = (username, password or "") if username else None
        self._auth: str | None = None          # the Authorization header value once negotiated
        self._http = httpx2.Client(timeout=timeout_s, follow_redirects=True)

    def __repr__(self) -> str:
        return f"Registry({self.host}/{self.repository})"

    def close(self) -> None:
        self._http.close()

    # -- reading ------------------------------------------------------------------------------

    def manifest(self, reference: str) -> tuple[str, bytes, str]:
        """(digest, bytes, media type) of the manifest `reference` (a tag or a digest) names."""
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        with self.request("GET", f"/manifests/{reference}", {"Accept": accept},
                          what=f"tag or digest {reference!r}") as r:
            body = read_bounded(r, MAX_MANIFEST_BYTES, f"{self.where()}: the manifest")
            media = r.headers.get("Content-Type", "").split(";")[0].strip()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and reference != digest:
            raise RemoteError(f"{self.where()}: the manifest's bytes do not match {reference}")
        return digest, body, media

    @contextmanager
    def blob(self, digest: str, headers: dict | None = None) -> Iterator[httpx2.Response]:
        """The streamed answer to a GET of a blob (with `headers`, e.g. a Range)."""
        with self.request("GET", f"/blobs/{digest}", headers or {}, what=f"blob {digest[:19]}") as r:
            yield r

    def has_blob(self, digest: str) -> bool:
        with self.request("HEAD", f"/blobs/{digest}", {}, what="", missing_ok=True) as r:
            return r.status_code == 200

    # -- writing ------------------------------------------------------------------------------

    def upload_blob(self, digest: str, size: int, content) -> None:
        """Upload one blob (monolithic: POST to open the upload, PUT its bytes with the digest)."""
        with self.request("POST", "/blobs/uploads/", {"Content-Length": "0"}, what="upload session") as r:
            location = r.headers.get("Location")
        if not location:
            raise RemoteError(f"{self.where()}: the registry opened an upload without a Location")
        url = httpx2.URL(self.base).join(location)
        url = url.copy_merge_params({"digest": digest})
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        with self.request("PUT", str(url), headers, what="upload session", content=content):
            pass

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> None:
        with self.request("PUT", f"/manifests/{reference}", {"Content-Type": media_type},
                          what="manifest", content=body):
            pass

    # -- the one request path, with the auth challenge ------------------------------------------

    @contextmanager
    def request(self, method: str, path: str, headers: dict, what: str, content=None,
                missing_ok: bool = False) -> Iterator[httpx2.Response]:
        url = path if path.startswith("http") else self.base + path
        # Credentials go to the registry itself only, never to a host an answer points elsewhere
        # (an upload's Location; redirects drop them already).
        target, base = httpx2.URL(url), httpx2.URL(self.base)
        own = (target.scheme, target.netloc) == (base.scheme, base.netloc)
        for attempt in (0, 1):
            sent = {**headers, **({"Authorization": self._auth} if self._auth and own else {})}
            if hasattr(content, "seek"):
                content.seek(0)
            try:
                with self._http.stream(method, url, headers=sent, content=content) as r:
                    if r.status_code == 401 and attempt == 0 and own and self._negotiate(r):
                        continue
                    if r.status_code >= 400 and not (missing_ok and r.status_code == 404):
                        raise self._error(r, what)
                    yield r
                    return
            except httpx2.HTTPError as e:
                raise Unreachable(f"{self.where()}: cannot reach the registry ({type(e).__name__})") from None

    def _negotiate(self, r: httpx2.Response) -> bool:
        """Answer a 401's challenge; False when there is nothing more to try."""
        scheme, _, rest = r.headers.get("WWW-Authenticate", "").partition(" ")
        params = dict(_PARAM.findall(rest))
        if scheme.lower() == "basic":
            if self._basic is None or self._auth is not None:
                return False
            user, password = self._basic
            self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            return True
        if scheme.lower() == "bearer":
            realm = httpx2.URL(params.get("realm", ""))
            plain_ok = is_loopback(realm.host) or (self.plain_http and realm.host.lower() == httpx2.URL(self.base).host)
            if not (realm.scheme == "https" or (realm.scheme == "http" and plain_ok)):
                raise RemoteError(f"{self.where()}: the registry's token service is not an https "
                                  "URL; credentials are not sent to it")
            self._auth = "Bearer " + self._token(params)
            return True
        return False

    def _token(self, params: dict[str, str]) -> str:
        query = {"service": params.get("service", ""),
                 "scope": params.get("scope") or f"repository:{self.repository}:pull"}
        auth = httpx2.BasicAuth(*self._basic) if self._basic else None
        try:
            with self._http.stream("GET", params["realm"], params=query, auth=auth) as r:
                if r.status_code in (401, 403):
                    creds = "the credentials" if self._basic else "anonymous access (no credentials given)"
                    raise Unauthorized(f"{self.where()}: the registry's token service refused "
                                       f"{creds} (HTTP {r.status_code})")
                if r.status_code != 200:
                    error = Unreachable if busy(r.status_code) else RemoteError
                    raise error(f"{self.where()}: the registry's token service answered HTTP {r.status_code}")
                body = read_bounded(r, MAX_TOKEN_BYTES, f"{self.where()}: the token")
        except httpx2.HTTPError as e:
            raise Unreachable(f"{self.where()}: cannot reach the registry's token service "
                              f"({type(e).__name__})") from None
        try:
            answer = boundedjson.loads(body, _JSON_DEPTH)
            token = answer.get("token") or answer.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not re.fullmatch(r"[\x21-\x7e]{1,16384}", token):
            raise RemoteError(f"{self.where()}: the registry's token service answered no token")
        return token

    def _error(self, r: httpx2.Response, what: str) -> RemoteError:
        try:
            code = _registry_code(read_bounded(r, MAX_ERROR_BYTES, "the error"))
        except (RemoteError, httpx2.HTTPError):
            code = ""
        where = self.where()
        if r.status_code in (401, 403) or code in ("UNAUTHORIZED", "DENIED"):
            creds = "the credentials" if self._basic else "anonymous access (no credentials given)"
            return Unauthorized(f"{where}: the registry refused {creds} (HTTP {r.status_code})")
        if code == "NAME_UNKNOWN":
            return NotFound(f"{where}: no such repository in the registry")
        if r.status_code == 404 or code.endswith("_UNKNOWN"):
            return NotFound(f"{where}: no {what}" if what else f"{where}: not found")
        error = Unreachable if busy(r.status_code) else RemoteError
        return error(f"{where}: the registry answered HTTP {r.status_code} for {what}"
                           + (f" ({code})" if code else ""))

    def where(self) -> str:
        return f"oci://{self.host}/{self.repository}"


def _registry_code(body: bytes) -> str:
    """The first error code of a distribution API error body, or ''."""
    try:
        errors = boundedjson.loads(body, _JSON_DEPTH).get("errors") or []
        code = errors[0].get("code", "") if errors else ""
        return code if isinstance(code, str) and len(code) < 64 else ""
    except Exception:     # not read, not JSON, not the shape: no code
        return ""
