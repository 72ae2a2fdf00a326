"""What a store's listing must satisfy before it is believed: every name, size, count and checksum a
store answers is checked here, once for the Hub and OCI registries, so a broken or hostile store
cannot make the fetcher write outside the model's folder, allocate without bound or skip a check.
"""
from __future__ import annotations

import hashlib
import re

from shardwise.worker.fetch.remote import (
    MAX_LISTED_FILES, MAX_NAME_BYTES, Checksum, ChecksumKind, RemoteError, RemoteFile,
)

# A single model file larger than this is not a model file (the largest safetensors shards are a few
# tens of GB): a size above it is a store's error, refused before anything is allocated for it.
MAX_FILE_BYTES = 1 << 44      # 16 TiB
_HEX = {ChecksumKind.SHA256: re.compile(r"[0-9a-f]{64}"), ChecksumKind.MD5: re.compile(r"[0-9a-f]{32}"),
        ChecksumKind.GIT_BLOB_SHA1: re.compile(r"[0-9a-f]{40}"),
        ChecksumKind.S3_MULTIPART_MD5: re.compile(r"[0-9a-f]{32}-[1-9][0-9]{0,4}")}
_OPAQUE = re.compile(r"[!-~]{1,256}")   # printable ASCII, no spaces: a tag compared, never parsed


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a model file's relative name, or None when it can."""
    if not isinstance(name, str) or not name:
        return "an empty or non-text name"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"a name longer than {MAX_NAME_BYTES} bytes"
    if name.startswith("/") or "\\" in name or any(ord(c) < 32 for c in name):
        return f"the name {name[:80]!r} (absolute, or with a backslash or control character)"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return f"the name {name[:80]!r} (an empty, '.' or '..' path segment)"
    return None


def checked_file(where: str, name: object, size: object, checksum: Checksum | None) -> RemoteFile:
    """A RemoteFile from what a store listed, or RemoteError naming what is wrong with it."""
    problem = name_problem(name)
    if problem:
        raise RemoteError(f"{where}: the store listed {problem}; refusing the listing")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
        raise RemoteError(f"{where}: the store listed {name} with an invalid size {str(size)[:40]!r}")
    if checksum is not None:
        pattern = _HEX.get(checksum.kind, _OPAQUE)
        if not isinstance(checksum.value, str) or not pattern.fullmatch(checksum.value):
            raise RemoteError(f"{where}: the store listed {name} with a malformed {checksum.kind.value} "
                              "checksum")
    return RemoteFile(name=name, size=size, checksum=checksum)  # type: ignore[arg-type]


def checked_listing(where: str, files: list[RemoteFile]) -> list[RemoteFile]:
    """The listing, sorted by name, once its length is bounded and no name is listed twice."""
    if len(files) > MAX_LISTED_FILES:
        raise RemoteError(f"{where}: the store listed more than {MAX_LISTED_FILES} files")
    seen: set[str] = set()
    for f in files:
        if f.name in seen:
            raise RemoteError(f"{where}: the store listed {f.name} twice")
        seen.add(f.name)
    return sorted(files, key=lambda f: f.name)


def git_blob_sha1(size: int):
    """A hasher of a git blob's id (what the Hub lists for a file not stored in LFS): sha1 over
    'blob <size>\\0' and the bytes."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % size)
    return h
