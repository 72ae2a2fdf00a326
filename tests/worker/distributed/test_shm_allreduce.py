"""The shared-memory all-reduce of a TP group, between real gloo ranks on this host: exact sums at
every step with ranks at different paces, the same bits on every rank, gloo for what does not
fit, no file left behind, off by environment, a dead peer reported instead of waited for."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import platform
import random
import socket
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.worker.distributed import tensor_parallel as parallel
from shardwise.worker.distributed.shm_allreduce import ENV, SLOT_BYTES

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="shared-memory all-reduce is for x86-64 only")

ITERS = 300
SHAPES = [(1, 576), (4, 1, 96), (3,), (2, 5, 7)]
BIG = SLOT_BYTES // 4 + 1        # float32 elements: one more than a slot holds


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(fn, rank, world, port, env, results) -> None:
    os.environ.pop(ENV, None)
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, fn(rank, world, dist.new_group(list(range(world))))))
    except Exception as e:  # noqa: BLE001 - the test reports it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        parallel.close_shm_allreduces()
        dist.destroy_process_group()


def _run(fn, world: int, env: dict | None = None, answers: int | None = None) -> dict:
    """fn(rank, world, group) in `world` forked ranks; {rank: what it returned} for the first
    `answers` (default: all) ranks to return."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(fn, r, world, port, env or {}, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=60) for _ in range(answers or world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _values(it: int, rank: int, shape) -> torch.Tensor:
    """Integers: float32 sums of a few of them are exact, so any mix-up shows."""
    g = torch.Generator().manual_seed(it * 1000 + rank)
    return torch.randint(-4096, 4096, shape, generator=g).float()


def _exact_sums(rank, world, group):
    assert parallel.use_shm_allreduce(group, timeout=30)
    shm = parallel._SHM[group]
    mapped = [line for line in open("/proc/self/maps") if "shardwise-allreduce-" in line]
    assert mapped and all(line.rstrip().endswith("(deleted)") for line in mapped), mapped
    assert not os.path.isdir("/dev/shm") or all(" /dev/shm/" in line for line in mapped), mapped
    pace = random.Random(rank)
    digest = hashlib.sha256()
    through_shm = 0
    for it in range(ITERS):
        big = it % 50 == 49
        shape = (BIG,) if big else SHAPES[it % len(SHAPES)]
        parts = [_values(it, r, shape) for r in range(world)]
        x = parts[rank].clone()
        parallel.all_reduce(x, group)
        assert torch.equal(x, sum(parts)), f"iteration {it}: wrong sum"
        noisy = torch.randn(2, 33, generator=torch.Generator().manual_seed(it * 1000 + rank))
        digest.update(parallel.all_reduce(noisy, group).numpy().tobytes())
        through_shm += 1 if big else 2
        if rank == world - 1 and pace.random() < 0.1:   # a slow rank, now and then past the spin
            time.sleep(pace.choice([0.0002, 0.004]))
    assert shm.calls == through_shm, (shm.calls, through_shm)   # the big ones went through gloo
    return digest.hexdigest()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_exact_and_identical_on_every_rank(world):
    digests = _run(_exact_sums, world)
    assert all(len(d) == 64 for d in digests.values()), digests
    assert len(set(digests.values())) == 1


def _gloo_only(rank, world, group):
    if rank == 1 and world == 3:
        os.environ[ENV] = "0"
    on = parallel.use_shm_allreduce(group, timeout=30)
    x = _values(0, rank, (1, 576))
    parallel.all_reduce(x, group)
    assert torch.equal(x, sum(_values(0, r, (1, 576)) for r in range(world)))
    return on


def test_switched_off_on_any_rank_means_gloo_for_the_whole_group():
    assert _run(_gloo_only, 2, {ENV: "0"}) == {0: False, 1: False}
    assert _run(_gloo_only, 3) == {0: False, 1: False, 2: False}   # off on rank 1 only


def _peer_dies(rank, world, group):
    assert parallel.use_shm_allreduce(group, timeout=30)
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        parallel.all_reduce(torch.ones(4), group)
    except dist.DistBackendError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


def test_a_dead_peer_is_an_error_not_a_hang():
    message, waited = _run(_peer_dies, 2, answers=1)[0]
    assert message == "shared-memory all-reduce: rank 1 has exited"
    assert waited < 5
