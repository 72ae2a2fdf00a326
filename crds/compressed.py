"""Gzip for what the operator writes and pods read back, with the decompressed size bounded.

A few kilobytes of gzip may inflate to gigabytes (a decompression bomb), so reading stops one byte
past the caller's limit and refuses: memory stays bounded by the limit, never by what the data claims.
"""
from __future__ import annotations

import gzip
import zlib

MAGIC = b"\x1f\x8b"     # how every gzip stream begins (RFC 1952)


class Unreadable(ValueError):
    """Data that is not one whole gzip stream, or that inflates past the limit: one line, to be
    prefixed with what was read (a file's path)."""


def compress(data: bytes) -> bytes:
    # mtime 0: the same input compresses to the same bytes, so writing it again changes nothing.
    return gzip.compress(data, compresslevel=9, mtime=0)


def is_gzip(data: bytes) -> bool:
    return data[:2] == MAGIC


def decompress(data: bytes, limit: int) -> bytes:
    """One gzip stream's content, at most `limit` bytes; Unreadable otherwise."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)    # gzip header and trailer, not raw zlib
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise Unreadable(f"is not valid gzip ({e})") from None
    if len(out) > limit:
        raise Unreadable(f"inflates to more than {limit / 2**20:g} MiB")
    if not inflater.eof:
        raise Unreadable("is truncated gzip")
    if inflater.unused_data:
        raise Unreadable("has data after its gzip stream")
    return out
