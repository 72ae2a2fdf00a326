"""A downloaded file's checksum, computed the way its store computed the one it listed: a digest of the
bytes (sha256, md5, a git blob's sha1), streamed as a single stream writes them or read back from the
file once parts written at once are all in; an S3 multipart upload's ETag, the md5 of its parts'
binary md5s, in the part sizes the store answers. The cache (cache.py) compares the result.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from shardwise.worker.fetch import trust
from shardwise.worker.fetch.remote import READ_CHUNK, ChecksumKind, Remote, RemoteFile

# Read back in this many bytes at a time (hashlib releases the GIL for such buffers, so several files
# are hashed at once).
_READ_BACK = READ_CHUNK


def hasher(f: RemoteFile):
    """A fresh digest of the bytes for `f`'s checksum kind, or None when its kind is not a digest of
    the bytes (a multipart ETag, an opaque tag, none)."""
    kind = f.checksum.kind if f.checksum else None
    if kind is ChecksumKind.SHA256:
        return hashlib.sha256()
    if kind is ChecksumKind.MD5:
        return hashlib.md5(usedforsecurity=False)
    if kind is ChecksumKind.GIT_BLOB_SHA1:
        return trust.git_blob_sha1(f.size)
    return None


def computed(remote: Remote, f: RemoteFile, path: Path, streamed=None) -> Optional[str]:
    """The checksum of the file at `path` in `f.checksum`'s kind (lower-case hex, a multipart ETag as
    '<hex>-<parts>'), or None when the kind cannot be recomputed. `streamed`: the digest already fed
    every byte in order, when one stream wrote the file."""
    if f.checksum is None:
        return None
    if f.checksum.kind is ChecksumKind.S3_MULTIPART_MD5:
        return _multipart(remote, f, path)
    digest = streamed or hasher(f)
    if digest is None:
        return None
    if streamed is None:
        with open(path, "rb") as src:
            while block := src.read(_READ_BACK):
                digest.update(block)
    return digest.hexdigest()


def multipart_etag(path: Path, part_sizes: list[int]) -> str:
    """The ETag S3 gives an object uploaded in parts of these sizes: md5 of the parts' md5s, '-N'."""
    outer = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as src:
        for size in part_sizes:
            inner = hashlib.md5(usedforsecurity=False)
            left = size
            while left and (block := src.read(min(left, _READ_BACK))):
                inner.update(block)
                left -= len(block)
            outer.update(inner.digest())
    return f"{outer.hexdigest()}-{len(part_sizes)}"


def _multipart(remote: Remote, f: RemoteFile, path: Path) -> Optional[str]:
    part_sizes = getattr(remote, "part_sizes", None)   # remote.PartSized
    if part_sizes is None:
        return None
    parts = int(f.checksum.value.rsplit("-", 1)[1])   # type: ignore[union-attr]
    got = multipart_etag(path, part_sizes(f.name, f.size, parts))
    if got != f.checksum.value:   # the parts were guessed equal from the first: ask each one's size
        got = multipart_etag(path, part_sizes(f.name, f.size, parts, exact=True))
    return got

