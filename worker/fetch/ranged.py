"""HTTP bodies read with a bound: a whole small answer (a listing, a manifest, a token, an error) up
to a limit, and exactly bytes [start, end) of a file out of a response to a request that asked for
them.

The Hub's resolve URLs and an OCI registry's blobs both answer `Range`; a server may still ignore it
(200 and the whole body) or answer another range than asked. Both are handled here once: a 206 must
say it starts where asked, a 200 is read from its start and the leading bytes skipped, and never
more than asked is yielded nor less without an error.
"""
from __future__ import annotations

import re
from typing import Iterator

import httpx2

from shardwise.worker.fetch.remote import READ_CHUNK, RemoteError, Unreachable, busy

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def range_header(start: int, end: int, size: int) -> dict[str, str]:
    """The Range header for [start, end) of a file of `size` bytes: none for the whole file."""
    return {} if start == 0 and end == size else {"Range": f"bytes={start}-{end - 1}"}


def body_slice(response: httpx2.Response, start: int, end: int, where: str) -> Iterator[bytes]:
    """The bytes [start, end) of the file `response` answers for, in chunks of at most READ_CHUNK."""
    skip = start
    if response.status_code == 206:
        m = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if not m or int(m.group(1)) != start:
            raise RemoteError(f"{where}: the store answered another byte range than asked "
                              f"({response.headers.get('Content-Range', 'none')[:60]})")
        skip = 0
    elif response.status_code != 200:
        error = Unreachable if busy(response.status_code) else RemoteError
        raise error(f"{where}: unexpected HTTP {response.status_code} reading the file")
    want = end - start
    for chunk in response.iter_bytes(READ_CHUNK):
        if skip:
            dropped = min(skip, len(chunk))
            chunk, skip = chunk[dropped:], skip - dropped
        if len(chunk) >= want:
            if want:
                yield chunk[:want]
            return
        want -= len(chunk)
        if chunk:
            yield chunk
    raise RemoteError(f"{where}: the store's answer ended {want} bytes short of the range asked")


def read_bounded(r: httpx2.Response, limit: int, what: str) -> bytes:
    """The whole body of a streamed response, refused in one line when it is longer than `limit`."""
    if int(r.headers.get("Content-Length") or 0) > limit:
        raise RemoteError(f"{what} is larger than {limit} bytes; refused")
    parts, total = [], 0
    for chunk in r.iter_bytes():
        total += len(chunk)
        if total > limit:
            raise RemoteError(f"{what} is larger than {limit} bytes; refused")
        parts.append(chunk)
    return b"".join(parts)
