"""The Hugging Face Hub store behind `hf://org/name[@revision]`, read through the official client.

The listing is one `model_info` call with file metadata at the requested revision: it answers the
commit sha the branch or tag points at (the revision this store pins, so a moved branch is a new
cache entry) and every file's size with the sha256 of LFS files (the weights) or the git blob id of
the small ones (config, tokenizer), both verified when a whole file is read. Byte ranges are read
from the resolve URL at that commit with a Range header, through the client's own HTTP session
(retries on 429/5xx, its redirects to the Hub's storage, the Authorization header kept off other
hosts).

The endpoint is the constructor's, else HF_ENDPOINT, else the public Hub; the token the
constructor's, else HF_TOKEN, else none (never a token saved on the machine). The token is never
logged nor put in a message.
"""
from __future__ import annotations

import os
import re
from typing import Iterator
from urllib.parse import quote

import httpx2
from huggingface_hub import ModelInfo, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
    RepositoryNotFoundError, RevisionNotFoundError,
)
from huggingface_hub.utils import (
    build_hf_headers, get_session, hf_raise_for_status, http_stream_backoff, validate_repo_id,
)

from shardwise.crds import boundedjson
from shardwise.worker.fetch import trust
from shardwise.worker.fetch.ranged import body_slice, range_header, read_bounded
from shardwise.worker.fetch.remote import (
    Checksum, ChecksumKind, NotFound, RemoteError, RemoteFile, Unauthorized, Unreachable, busy,
)

PUBLIC_ENDPOINT = "https://huggingface.co"
# Seconds to wait for the Hub to answer a request (and between two chunks of a download): a hung
# connection fails in one line and the fetcher's retry starts over, rather than hanging the pod.
REQUEST_TIMEOUT_S = 60.0
# Retries of one request on 429/5xx or a dropped connection, by the client's own backoff.
REQUEST_RETRIES = 3
# The listing's JSON: ~300 bytes a file, so MAX_LISTED_FILES files fit with room to spare.
MAX_LISTING_BYTES = 64 << 20
# An error's body is read only this far, for the Hub's message.
MAX_ERROR_BYTES = 64 << 10
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubRemote:
    """One model repository on a Hub endpoint at one revision (None: the repository's default
    branch); optionally one named file of it (a `.gguf` among several quantisations), in which case
    only that file is listed."""

    def __init__(self, repo_id: str, revision: str | None = None, filename: str | None = None,
                 endpoint: str | None = None, token: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S):
        self.repo_id = repo_id
        self.requested = revision or None
        self.filename = filename
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or PUBLIC_ENDPOINT).rstrip("/")
        # False, not None, when there is no token: the client would otherwise look for one saved on
        # the machine, and a pod's fetch must use only the credentials its spec names.
        self._token: str | bool = token or os.environ.get("HF_TOKEN") or False
        self._timeout = timeout_s
        self._files: dict[str, RemoteFile] | None = None
        self._sha: str | None = None

    def __repr__(self) -> str:        # never the token
        return f"HubRemote({self.describe()!r}, endpoint={self.endpoint!r})"

    def describe(self) -> str:
        return (f"hf://{self.repo_id}" + (f"@{self.requested}" if self.requested else "")
                + (f"/{self.filename}" if self.filename else ""))

    def revision(self) -> str:
        self._load()
        return self._sha  # type: ignore[return-value]

    def list_files(self) -> list[RemoteFile]:
        self._load()
        return list(self._files.values())  # type: ignore[union-attr]

    def read(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        self._load()
        f = self._files.get(name)  # type: ignore[union-attr]
        if f is None:
            raise NotFound(f"{self.describe()}: no file {name[:200]!r} in the listing")
        end = f.size if end is None else min(end, f.size)
        if not 0 <= start <= end:
            raise RemoteError(f"{self.describe()}: bad byte range [{start}, {end}) of {name}")
        return self._stream(f, start, end)

    def _stream(self, f: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        if start == end:
            return
        where = f"{self.describe()} {f.name}"
        url = hf_hub_url(self.repo_id, f.name, revision=self._sha, endpoint=self.endpoint)
        headers = {**build_hf_headers(token=self._token), **range_header(start, end, f.size),
                   "Accept-Encoding": "identity"}
        try:
            with http_stream_backoff("GET", url, headers=headers, timeout=self._timeout,
                                     max_retries=REQUEST_RETRIES) as response:
                if response.status_code >= 400:
                    _raise_for_status(response, MAX_ERROR_BYTES)
                # the bytes are checked against f.checksum once, by the cache that writes them
                yield from body_slice(response, start, end, where)
        except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled, HFValidationError) as e:
            raise self._one_line(e) from None

    def _load(self) -> None:
        if self._files is not None:
            return
        try:
            info = self._model_info()
        except (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled, HFValidationError) as e:
            raise self._one_line(e) from None
        if not isinstance(info.sha, str) or not _COMMIT.fullmatch(info.sha):
            raise RemoteError(f"{self.describe()}: the Hub answered no commit sha for the revision")
        files = [self._file(s) for s in info.siblings or []]
        if self.filename is not None:
            files = [f for f in files if f.name == self.filename]
            if not files:
                raise NotFound(f"{self.describe()}: the repository has no file {self.filename!r} "
                               f"at {self.requested or 'its default branch'}")
        self._files = {f.name: f for f in trust.checked_listing(self.describe(), files)}
        self._sha = info.sha

    def _model_info(self) -> ModelInfo:
        """What `HfApi.model_info(repo, revision=..., files_metadata=True)` answers, asked the same
        way through the client's session, its headers and its error mapping, but with the answer's
        size bounded before it is parsed (the client would read any length)."""
        validate_repo_id(self.repo_id)
        rev = f"/revision/{quote(self.requested, safe='')}" if self.requested else ""
        url = f"{self.endpoint}/api/models/{self.repo_id}{rev}"
        with get_session().stream("GET", url, headers=build_hf_headers(token=self._token),
                                  params={"blobs": True}, timeout=self._timeout) as r:
            body = _raise_for_status(r, MAX_LISTING_BYTES)
        try:
            return ModelInfo(**boundedjson.loads(body, boundedjson.MODEL_JSON_DEPTH))
        except (ValueError, TypeError, KeyError, AttributeError):
            raise RemoteError(f"{self.describe()} on {self.endpoint}: the Hub's answer is not a "
                              "model's description") from None

    def _file(self, sibling) -> RemoteFile:
        if sibling.lfs is not None:
            checksum = Checksum(ChecksumKind.SHA256, str(sibling.lfs.sha256).lower())
            size = sibling.lfs.size
        else:
            # A file kept in git itself: its blob id is the sha1 of a git blob (recomputed by the
            # cache); anything else is a tag compared between listings.
            blob = str(sibling.blob_id or "")
            kind = ChecksumKind.GIT_BLOB_SHA1 if _COMMIT.fullmatch(blob) else ChecksumKind.OPAQUE
            checksum = Checksum(kind, blob) if blob else None
            size = sibling.size
        return trust.checked_file(self.describe(), sibling.rfilename, size, checksum)

    def _one_line(self, e: Exception) -> RemoteError:
        where = f"{self.describe()} on {self.endpoint}"
        if isinstance(e, GatedRepoError):
            return Unauthorized(f"{where}: the repository is gated and the token's account has not "
                                "been granted access")
        if isinstance(e, RepositoryNotFoundError):
            hint = "" if self._token else " (a private repository needs a token: HF_TOKEN)"
            return NotFound(f"{where}: no such repository, or the token cannot see it{hint}")
        if isinstance(e, RevisionNotFoundError):
            return NotFound(f"{where}: no revision {self.requested!r} (a branch, tag or commit sha)")
        if isinstance(e, EntryNotFoundError):
            return NotFound(f"{where}: a listed file is missing at the pinned commit")
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            code = e.response.status_code
            if code in (401, 403):
                return Unauthorized(f"{where}: the Hub refused the token (HTTP {code})")
            return (Unreachable if busy(code) else RemoteError)(f"{where}: the Hub answered HTTP {code}")
        if isinstance(e, HFValidationError):
            return NotFound(f"{where}: not a valid repository id or revision")
        if isinstance(e, OfflineModeIsEnabled):
            return RemoteError(f"{where}: HF_HUB_OFFLINE is set, so the Hub is not asked")
        return Unreachable(f"{where}: cannot reach the Hub ({type(e).__name__})")


def _raise_for_status(r: httpx2.Response, limit: int) -> bytes:
    """The body of a streamed answer, read up to `limit` bytes; the client's own error (RepoNotFound,
    RevisionNotFound, ...) when its status is one."""
    body = read_bounded(r, limit, "the Hub's answer")
    # The body is already decoded: the copy the client inspects must not say it is compressed.
    headers = {k: v for k, v in r.headers.items() if k.lower() not in ("content-encoding", "content-length")}
    shown = body
    if r.status_code >= 400:       # the client parses an error's body with a plain json.loads
        try:
            boundedjson.loads(body, 8)
        except boundedjson.JSONRefused:
            shown = b""
    hf_raise_for_status(httpx2.Response(r.status_code, headers=headers, content=shown, request=r.request))
    return body
