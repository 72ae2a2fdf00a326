"""What every remote model store answers: a listing of the model's files and a byte range of one.

A store (S3, the Hugging Face Hub, an OCI registry) is read only through this interface, so the
cache, the per-rank file selection, progress and retries are written once for all of them. A store
is constructed from a parsed uri and the credentials the pod was given; it never logs them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Protocol

from shardwise.crds import names

# Bounds on what a store may answer: a listing longer than this, or a name longer than this, is
# refused in one line (a hostile or broken store must not make the fetcher use unbounded memory).
MAX_LISTED_FILES = 100_000
MAX_NAME_BYTES = 1024
# The size of one chunk a read yields: big enough to amortise a request, small enough to bound memory.
READ_CHUNK = 8 << 20
# A store is read by at most this many concurrent reads (the cache's parallel streams are bounded by
# it; a store's client keeps this many connections).
MAX_STREAMS = names.MAX_FETCH_STREAMS
# S3 allows at most this many parts in one multipart upload.
MAX_MULTIPART_PARTS = 10_000


class ChecksumKind(str, enum.Enum):
    """How a store vouches for a file's bytes. The cache (cache.py) is the one place that checks
    them, over the bytes it wrote, a download resumed after an error included; a store only lists
    them and streams bytes."""
    SHA256 = "sha256"       # the Hub's LFS files, OCI layer digests: verified on the bytes
    MD5 = "md5"             # an S3 ETag of a single-part upload is the MD5 of the object
    GIT_BLOB_SHA1 = "git-blob-sha1"   # the Hub's small files (kept in git): sha1 of 'blob <size>\0' + bytes
    # An S3 multipart upload's ETag '<hex>-<parts>': the MD5 of the parts' binary MD5s, recomputed
    # over the file in the part sizes the store answers (PartSized)
    S3_MULTIPART_MD5 = "s3-multipart-md5"
    OPAQUE = "opaque"       # any other tag: compared, never recomputed


@dataclass(frozen=True)
class Checksum:
    kind: ChecksumKind
    value: str              # lower-case hex for SHA256/MD5; the store's tag otherwise


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model as its store lists it. `name` is '/'-separated and relative to the model's
    root (never absolute, never with '..': the cache refuses such names)."""
    name: str
    size: int
    checksum: Checksum | None = None


class RemoteError(Exception):
    """A store could not answer; the message is one line a user can act on (no credentials in it)."""


class NotFound(RemoteError):
    """The bucket, repository, revision, tag or file does not exist."""


class Unauthorized(RemoteError):
    """The store refused the credentials (or asked for some and none were given)."""


class Unreachable(RemoteError):
    """The store could not be asked, or said it is busy: no connection, a timeout, HTTP 5xx or 429.
    Unlike the others, asking again later may succeed (the operator's probe retries these)."""


# The HTTP statuses that say "later": the server's own trouble, or too many requests.
def busy(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


class Remote(Protocol):
    """A model's files in one store at one pinned revision."""

    def describe(self) -> str:
        """The uri as a user wrote it, for messages; never carries a credential."""
        ...

    def revision(self) -> str:
        """What pins the content: a commit sha, a manifest digest, or for S3 a digest of the listing's
        ETags. Part of the cache key, so a moved tag or a rewritten prefix is a new cache entry."""
        ...

    def list_files(self) -> list[RemoteFile]:
        """Every file under the model's root, at most MAX_LISTED_FILES."""
        ...

    def read(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes [start, end) of one file (end None: to its end), in chunks of at most READ_CHUNK.
        A store that cannot serve ranges reads from the start and skips (slow, still correct).
        Called from up to MAX_STREAMS threads at once (the cache's parallel streams): each store's
        client is one that is safe to share between threads (boto3's client, huggingface_hub's
        httpx session, the registry's httpx client)."""
        ...


class PartSized(Protocol):
    """A store whose checksum of a file depends on how it was uploaded in parts (S3 multipart)."""

    def part_sizes(self, name: str, size: int, parts: int, exact: bool = False) -> list[int]:
        """The sizes of the `parts` parts `name` (of `size` bytes) was uploaded in. Not `exact`: from
        the first part's size, the others equal but the last (one request); `exact`: each part's."""
        ...
