"""Sum-all-reduce through shared memory, for the small CPU all-reduces of a tensor-parallel group.

Gloo over loopback TCP takes ~0.7 ms per all-reduce even for a few KB (the peers' sleep and
wake-up latency dominates), and a TP decode step does two per layer. The ranks of a TP group run
on one host, so they can exchange the data through one file that every rank maps:

    [token][one counter per rank, each on its own cache line][per rank: two data slots]

The n-th all_reduce(x): copy x into my slot n % 2, publish n in my counter, wait until every
counter reads >= n, then sum the slots n % 2 in rank order into x, so every rank gets the same
bits. Two slots per rank are enough: a rank writes slot n % 2 again only at call n + 2, which it
starts after every peer has published n + 1, that is after each peer has finished reading call n.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import secrets
import tempfile
import time

import torch
import torch.distributed as dist

ENV = "SHARDWISE_SHM_ALLREDUCE"      # "0": always gloo
SLOT_BYTES = 1 << 20                 # larger tensors go to gloo, whose bandwidth is then what counts
_TOKEN_BYTES = 16
_LINE = 64                           # counters on separate cache lines: no false sharing
_PAGE = 4096                         # page-aligned slots: a slot's bytes view as any dtype
_SPIN_SECONDS = 0.002                # then sleep, so that more ranks than cores do not crawl
_SLEEP_SECONDS = 0.0001
_CHECK_SECONDS = 0.05                # while sleeping: how often to look for a dead peer or the timeout


def _data_offset(world: int) -> int:
    """Where the slots start: after the token's line and one line per rank, on a page boundary."""
    return -(-(world + 1) * _LINE // _PAGE) * _PAGE


def _file_size(world: int) -> int:
    return _data_offset(world) + 2 * world * SLOT_BYTES


def _supported() -> bool:
    # Plain stores publish the counter after the data, and plain loads read the data after the
    # counter: safe only where stores are not reordered with stores nor loads with loads (x86-64's
    # TSO). Elsewhere this would need memory fences, which Python cannot issue: gloo there.
    return os.environ.get(ENV, "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")


def _create(world: int) -> tuple[str, bytes]:
    """A new file for `world` ranks, its space reserved up front: on a full tmpfs a write through
    the mapping would kill the process with SIGBUS, posix_fallocate fails cleanly instead."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    token = secrets.token_bytes(_TOKEN_BYTES)
    path = os.path.join(folder, f"shardwise-allreduce-{token.hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, _file_size(world))
        os.pwrite(fd, token, 0)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path, token


class ShmAllReduce:
    """One rank's mapping of the group's file; `connect` makes one per rank, or none at all."""

    def __init__(self, path: str, token: bytes, rank: int, ranks: list[int], timeout: float):
        self.rank, self.ranks, self.timeout = rank, ranks, timeout
        self.calls = 0
        size = _file_size(len(ranks))
        self._fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(self._fd).st_size != size or os.pread(self._fd, _TOKEN_BYTES, 0) != token:
                raise ValueError(f"{path} is not the file rank 0 of the group created")
            # Held as long as this process lives (the kernel drops it when the process dies):
            # a peer waiting for this rank tests it to tell a dead rank from a slow one.
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._counters = memoryview(self._map).cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._data = _data_offset(len(ranks))
        self._peers = [p for p in range(len(ranks)) if p != rank]

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False (x untouched) when x is not for shared memory."""
        nbytes = x.numel() * x.element_size()
        if x.device.type != "cpu" or nbytes > SLOT_BYTES or not x.is_contiguous():
            return False
        self.calls += 1
        n = self.calls
        slots = [self._slot(p, n % 2, nbytes, x.dtype) for p in range(len(self.ranks))]
        flat = x.detach().view(-1)
        slots[self.rank].copy_(flat)
        self._counters[self._counter(self.rank)] = n
        for p in self._peers:
            self._wait(p, n)
        torch.add(slots[0], slots[1], out=flat)
        for s in slots[2:]:
            flat += s
        return True

    def close(self) -> None:
        self._counters.release()
        del self._bytes
        self._map.close()
        os.close(self._fd)

    def _slot(self, rank: int, parity: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = self._data + (2 * rank + parity) * SLOT_BYTES
        return self._bytes[start:start + nbytes].view(dtype)

    @staticmethod
    def _counter(rank: int) -> int:
        return (rank + 1) * _LINE // 8

    def _wait(self, peer: int, n: int) -> None:
        """Spin until `peer` publishes call n. sched_yield lets the peer run when ranks share a
        core and returns at once when they do not."""
        i = self._counter(peer)
        counters = self._counters
        if counters[i] >= n:
            return
        spin_until = time.perf_counter() + _SPIN_SECONDS
        while counters[i] < n:
            if time.perf_counter() > spin_until:
                self._sleep_until(peer, n)
                return
            os.sched_yield()

    def _sleep_until(self, peer: int, n: int) -> None:
        i = self._counter(peer)
        start = check_at = time.monotonic()
        while self._counters[i] < n:
            time.sleep(_SLEEP_SECONDS)
            now = time.monotonic()
            if now >= check_at:
                self._check_peer(peer, now - start)
                check_at = now + _CHECK_SECONDS

    def _check_peer(self, peer: int, waited: float) -> None:
        """Fail like a gloo collective would when the peer has exited or the timeout has passed."""
        if waited > self.timeout:
            raise dist.DistBackendError(f"shared-memory all-reduce: rank {self.ranks[peer]} did not "
                                        f"arrive within {self.timeout:.0f} s")
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, peer)
        except OSError:
            return      # the peer holds its lock: alive, just slow
        raise dist.DistBackendError(f"shared-memory all-reduce: rank {self.ranks[peer]} has exited")


def connect(group, timeout: float) -> ShmAllReduce | None:
    """Collective over `group` (a gloo group of two or more ranks): a ShmAllReduce on every rank
    when all of them can map the same file, else None on every rank (ranks on different hosts,
    no shared /dev/shm, not x86-64, or $SHARDWISE_SHM_ALLREDUCE=0 on any rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    wanted = _supported()
    offer: list = [None]
    if rank == 0 and wanted:
        with contextlib.suppress(OSError):
            offer[0] = _create(world)
    dist.broadcast_object_list(offer, src=ranks[0], group=group)
    reducer = None
    if wanted and offer[0] is not None:
        with contextlib.suppress(OSError, ValueError):
            reducer = ShmAllReduce(*offer[0], rank, ranks, timeout)
    everyone = torch.tensor([int(reducer is not None)])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if offer[0] is not None:
        # Every rank has mapped the file or given up: unlinked now, it leaves nothing behind
        # however the ranks end.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(offer[0][0])
    if reducer is not None and not everyone.item():
        reducer.close()
        reducer = None
    return reducer
