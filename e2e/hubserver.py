"""A local stand-in for the Hugging Face Hub's HTTP API, serving model folders to the official
`huggingface_hub` client (HF_ENDPOINT pointed at it), since the Hub itself cannot be reached from
the machines the tests and the benchmark run on.

It answers what the client calls to read a model, with the headers the client reads:
- `GET /api/models/{repo}[/revision/{rev}][?blobs=true]` (`HfApi.model_info`, `repo_info`): the id,
  the commit `sha` the revision resolves to and `siblings` (with `blobs`: each file's `size`, git
  `blobId`, and `lfs` {sha256, size, pointerSize} for the files the Hub would keep in LFS).
- `GET /api/models/{repo}/tree/{rev}[/{path}][?recursive=true]` (`HfApi.list_repo_tree`,
  `list_repo_files`): files and folders with `oid`, `size` and `lfs`.
- `HEAD` / `GET /{repo}/resolve/{rev}/{file}` (`hf_hub_download`, `get_hf_file_metadata`,
  `HfFileSystem`, a ranged read): `X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size`; a
  file kept in git is served there, an LFS file is a 302 to the storage host (`cdn_url`: the same
  server under the name `localhost`, another origin, so the client sends it no token), which
  serves it with `Content-Length`, `Accept-Ranges`, and for a `Range` request 206 with
  `Content-Range` (416 when the range is outside the file).
- JSON answers gzip-compressed when the client accepts it, as the Hub's CDN sends them.
- Errors as the Hub sends them: 404 with `X-Error-Code: RepoNotFound`, `RevisionNotFound` or
  `EntryNotFound`; with a token configured, 401 `RepoNotFound` without one (the Hub hides private
  repositories) and 401 `X-Error-Message: Invalid credentials in Authorization header` with a
  wrong one; 403 `X-Error-Code: GatedRepo` for a file of a repository in `gated` (the Hub lists a
  gated repository but serves its files only to accounts granted access).

A repository holds commits, each a snapshot of a folder taken by `publish` (files copied into a
content-addressed store, so a later change to the folder is a new commit), and branches and tags
naming them. It listens on loopback only. Start it with `with HubServer() as hub:` and publish.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# What the Hub keeps in LFS: weights by suffix, and any file above this size.
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".h5", ".onnx", ".msgpack")
LFS_ABOVE = 10 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Blob:
    path: Path            # the content-addressed copy
    size: int
    sha256: str
    git_oid: str          # the git blob id of the file, or of its LFS pointer
    lfs: bool
    pointer_size: int = 0

    def sibling(self, name: str) -> dict:
        entry: dict = {"rfilename": name, "size": self.size, "blobId": self.git_oid}
        if self.lfs:
            entry["lfs"] = {"sha256": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry

    def etag(self) -> str:
        return f'"{self.sha256 if self.lfs else self.git_oid}"'


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)     # branch or tag -> commit sha

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


def _git_oid(data_size: int, chunks) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % data_size)
    for c in chunks:
        h.update(c)
    return h.hexdigest()


class HubServer:
    """The stand-in endpoint; `url` is what HF_ENDPOINT is set to."""

    def __init__(self, token: str | None = None, store: Path | None = None):
        self.token = token
        self.gated: set[str] = set()      # repositories whose files the token's account may not read
        self._tmp = None if store else tempfile.TemporaryDirectory(prefix="shardwise-hub-")
        self.store = Path(store or self._tmp.name)   # type: ignore[union-attr]
        self.repos: dict[str, Repo] = {}
        # (method, path, Range, whether an Authorization header came) of every request seen
        self.requests: list[tuple[str, str, str | None, bool]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        # The same server under another name: another origin, as the Hub's storage host is, so a
        # client's redirect there carries no token.
        self.cdn_url = f"http://localhost:{self._httpd.server_address[1]}"
        self.blobs_by_sha: dict[str, Blob] = {}
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def publish(self, repo_id: str, folder: Path, branch: str = "main", tags: tuple[str, ...] = ()) -> str:
        """Commit the folder's files as the new head of `branch` (and tags); returns the commit sha."""
        files = {p.relative_to(folder).as_posix(): self._blob(p)
                 for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        listing = "\n".join(f"{n} {b.git_oid}" for n, b in sorted(files.items()))
        parent = self.repos.get(repo_id, Repo()).refs.get(branch, "")
        sha = hashlib.sha1(f"{parent}\n{listing}".encode()).hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo())
            repo.commits[sha] = files
            for ref in (branch, *tags):
                repo.refs[ref] = sha
        return sha

    def _blob(self, path: Path) -> Blob:
        size = path.stat().st_size
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                sha.update(chunk)
        digest = sha.hexdigest()
        target = self.store / digest
        if not target.exists():
            shutil.copyfile(path, target)
        lfs = path.suffix in LFS_SUFFIXES or size > LFS_ABOVE
        if not lfs:
            return Blob(target, size, digest, _git_oid(size, [target.read_bytes()]), False)
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\n"
                   f"size {size}\n").encode()
        blob = Blob(target, size, digest, _git_oid(len(pointer), [pointer]), True, len(pointer))
        self.blobs_by_sha[digest] = blob
        return blob


def _handler(hub: HubServer):
    class Handler(_HubHandler):
        server_hub = hub
    return Handler


_API = re.compile(r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)"
                  r"(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<path>/.*)?)?")
_CDN = re.compile(r"/cdn/(?P<sha>[0-9a-f]{64})")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


class _HubHandler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:     # quiet: tests read `requests` instead
        pass

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        url = urlsplit(self.path)
        hub = self.server_hub
        with hub._lock:
            hub.requests.append((self.command, url.path, self.headers.get("Range"),
                                 "Authorization" in self.headers))
        if m := _CDN.fullmatch(url.path):      # the storage host: signed URLs, no token
            blob = hub.blobs_by_sha.get(m["sha"])
            if blob is None:
                self._error(404, None, "no such object")
            else:
                self._file(blob, {"ETag": f'"{blob.sha256}"'}, head)
            return
        if not self._authorized():
            return
        if m := _API.fullmatch(url.path):
            self._api(m, parse_qs(url.query), head)
        elif m := _RESOLVE.fullmatch(url.path):
            self._resolve(m, head)
        else:
            self._error(404, "EntryNotFound", "no such route")

    def _authorized(self) -> bool:
        token = self.server_hub.token
        if token is None:
            return True
        got = self.headers.get("Authorization")
        if got is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return False
        if got != f"Bearer {token}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def _commit(self, repo_id: str, rev: str) -> tuple[str, dict[str, Blob]] | None:
        repo = self.server_hub.repos.get(unquote(repo_id))
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        sha = repo.resolve(unquote(rev))
        if sha is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return None
        return sha, repo.commits[sha]

    def _api(self, m: re.Match, query: dict, head: bool) -> None:
        found = self._commit(m["repo"], m["rev"] or "main")
        if found is None:
            return
        sha, files = found
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        if m["kind"] == "tree":
            body = self._tree(files, unquote(m["path"] or "").strip("/"),
                              query.get("recursive", ["false"])[0].lower() == "true")
        else:
            siblings = [b.sibling(n) if blobs else {"rfilename": n} for n, b in sorted(files.items())]
            repo_id = unquote(m["repo"])
            body = {"_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": False, "disabled": False, "tags": [], "siblings": siblings}
        self._json(200, body, head, {"X-Repo-Commit": sha})

    @staticmethod
    def _tree(files: dict[str, Blob], under: str, recursive: bool) -> list[dict]:
        prefix = f"{under}/" if under else ""
        out: dict[str, dict] = {}
        for name, blob in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                folder = prefix + rest.split("/", 1)[0]
                out.setdefault(folder, {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
                continue
            entry = {"type": "file", "oid": blob.git_oid, "size": blob.size, "path": name}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
            out[name] = entry
        return list(out.values())

    def _resolve(self, m: re.Match, head: bool) -> None:
        found = self._commit(m["repo"], m["rev"])
        if found is None:
            return
        sha, files = found
        if unquote(m["repo"]) in self.server_hub.gated:
            self._error(403, "GatedRepo", "Access to this model is restricted")
            return
        blob = files.get(unquote(m["path"]))
        if blob is None:
            self._error(404, "EntryNotFound", "Entry not found")
            return
        headers = {"X-Repo-Commit": sha, "ETag": blob.etag(), "X-Linked-Etag": blob.etag(),
                   "X-Linked-Size": str(blob.size)}
        if blob.lfs:     # the Hub redirects an LFS file to its storage host, on another origin
            self._send(302, {**headers, "Location": f"{self.server_hub.cdn_url}/cdn/{blob.sha256}",
                             "Content-Length": "0"})
            return
        self._file(blob, headers, head)

    def _file(self, blob: Blob, headers: dict, head: bool) -> None:
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        span = _range(self.headers.get("Range"), blob.size)
        if span is False:
            self._send(416, {**headers, "Content-Range": f"bytes */{blob.size}", "Content-Length": "0"})
            return
        start, end = span if span else (0, blob.size)
        if span:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        headers["Content-Length"] = str(end - start)
        self._send(206 if span else 200, headers)
        if not head:
            with open(blob.path, "rb") as f:
                f.seek(start)
                left = end - start
                while left:
                    chunk = f.read(min(_CHUNK, left))
                    self.wfile.write(chunk)
                    left -= len(chunk)

    def _json(self, code: int, body, head: bool, extra: dict | None = None) -> None:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(extra or {})}
        if "gzip" in self.headers.get("Accept-Encoding", ""):      # as the Hub's CDN compresses
            data = gzip.compress(data)
            headers["Content-Encoding"] = "gzip"
        self._send(code, {**headers, "Content-Length": str(len(data))})
        if not head:
            self.wfile.write(data)

    def _error(self, code: int, error_code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._json(code, {"error": message}, self.command == "HEAD", headers)

    def _send(self, code: int, headers: dict) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()


def _range(header: str | None, size: int):
    """(start, end) of a single `bytes=` range, None for no or an unparsable header (the whole file,
    as HTTP says), False when it is outside the file."""
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", (header or "").strip())
    if not m or m.group(1) == m.group(2) == "":
        return None
    if m.group(1) == "":
        n = int(m.group(2))
        return (max(0, size - n), size) if n else False
    start = int(m.group(1))
    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    return (start, end) if start < size and start < end else False
