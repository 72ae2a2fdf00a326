"""Where a CPU rank's weights sit in memory: one buffer backed by transparent huge pages.

A decode step streams every weight once from memory, one thread per rank; with 4 KiB pages that
stream takes a TLB miss every 4 KiB, with 2 MiB pages the same matrix-vector products read
faster (docs/worker.md, How it is built). Applied after the weights reach their inference form
(model/inference.py) and any quantization (weights/quantize.py), since it moves the matrices
they end up as.
"""
from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of zeroed CPU memory, 2 MiB-aligned, that the kernel is asked to back with
    transparent huge pages (madvise: the usual setting, under which torch's own allocations get
    4 KiB pages). None where mmap cannot ask for that."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(buf, dtype=torch.uint8)     # keeps `buf` alive as long as it lives
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip:skip + nbytes]


def place_in_huge_pages(model: nn.Module) -> int:
    """Move the model's CPU weight matrices into one huge-page buffer, in module order; returns its
    bytes (0 if nothing moved). Tied parameters are one object, so they move once and stay tied."""
    params, seen = [], set()
    for p in model.parameters():
        if p.dim() == 2 and p.device.type == "cpu" and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    align = 64                          # a cache line: every matrix starts on one
    sizes = [-(-p.numel() * p.element_size() // align) * align for p in params]
    if not params:
        return 0
    buf = huge_page_buffer(sum(sizes))
    if buf is None:
        return 0
    offset = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        dst = buf[offset:offset + nbytes].view(p.dtype).view(p.shape)
        dst.copy_(p.data)
        p.data = dst
        offset += size
    return offset
