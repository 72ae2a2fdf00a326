"""The supervisor of a group of rank processes, and the exit statuses of the worker's commands.

A group of ranks is one unit: the supervisor catches SIGINT/SIGTERM before the ranks start, passes
a signal on to them, and watches them until they all end or one fails, when the others are stopped.
What it sees is an `Outcome` (how the group ended, the ranks' statuses at that moment); each command
turns that into its own exit status with the table below (`Exit`, `STOPPED`).

Two kinds of group use it, differing where their `Policy` says:
- `shardwise train` on one machine: the signal received goes on to the ranks, which stop at a step
  they agree on; a second signal stops them at once; a failed rank ends the wait even while the
  others are stopping, and whatever still runs is killed.
- a pod (`shardwise worker`): SIGTERM goes on to the ranks, whatever the pod received; once they are
  stopping (a training rank stopping at an agreed step, serving rank 0 draining its requests), the
  pod waits for every rank, a failed one too (the pod's grace period bounds the wait), and asks
  what is left to stop, rank 0 first.

`stop_on_signals` is the same catch for a process that is itself rank 0 (`shardwise serve`, rank 0
of a pod): the signal only sets an event, and the engine drains its requests before stopping.
"""
from __future__ import annotations

import enum
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

CAUGHT = (signal.SIGINT, signal.SIGTERM)


class Exit(enum.IntEnum):
    """The exit statuses of the worker's commands and of their ranks."""
    OK = 0
    FAILED = 1                              # a rank failed and the group was stopped
    BAD_INPUT = 2                           # bad input, said in one line on stderr
    INTERRUPTED = 128 + signal.SIGINT       # 130: stopped by SIGINT at a step every rank agreed on
    TERMINATED = 128 + signal.SIGTERM       # 143: the same for SIGTERM


# What a rank returns when a signal stopped the job at an agreed step (128 + SIGINT / SIGTERM).
STOPPED = frozenset({Exit.INTERRUPTED, Exit.TERMINATED})


def stopped_by(sig: int) -> int:
    """The status of a process that a signal stopped: 128 + the signal, as a shell reports it."""
    return 128 + int(sig)


def exit_status(p) -> int | None:
    """A rank process's exit status, None while it runs. When the fork server that started the
    ranks is gone (a SIGTERM to the whole process group, as local nodes send it to a pod), its
    children live on, but multiprocessing reports 255 for every one of them: those are looked up
    by pid instead."""
    code = p.exitcode
    if code == 255:
        try:
            os.kill(p.pid, 0)
        except ProcessLookupError:
            return code
        except PermissionError:
            pass
        return None
    return code


def failed(codes: Sequence[int | None]) -> list[tuple[int, int]]:
    """(rank, status) of every rank that ended neither with 0 nor with a stop status."""
    return [(rank, c) for rank, c in enumerate(codes) if c not in (None, Exit.OK) and c not in STOPPED]


def stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT set the returned event, from now on (rank 0 in this process drains its
    requests when it is set, then stops the pipeline)."""
    stop = threading.Event()
    for sig in CAUGHT:
        signal.signal(sig, lambda *_: stop.set())
    return stop


class Ending(enum.Enum):
    DONE = "done"                # every rank exited 0
    STOPPED = "stopped"          # every rank exited 0 or with a stop status, one at least with one
    FAILED = "failed"            # a rank failed (`Outcome.failed` says which)
    ABORTED = "aborted"          # a second signal: the ranks were not waited for


@dataclass(frozen=True)
class Outcome:
    ending: Ending
    codes: tuple[int | None, ...]        # each rank's status when the supervisor decided, None: running
    signals: tuple[int, ...] = ()        # the signals the supervisor received, in order

    @property
    def failed(self) -> list[tuple[int, int]]:
        return failed(self.codes)

    @property
    def stop_status(self) -> int:
        """The first stop status (130/143) among the ranks', 0 when none stopped that way."""
        return next((c for c in self.codes if c in STOPPED), Exit.OK)


@dataclass(frozen=True)
class Policy:
    """Where groups of ranks differ in how they are watched."""
    forward: int | None = None           # the signal passed on to the ranks; None: the one received
    second_signal_aborts: bool = False   # a second signal ends the wait at once
    wait_out_failures: bool = False      # once the ranks are stopping, a failed one ends the wait only
                                         # when all have ended
    settle_s: float = 0.0                # after a failure, how long its peers get to fail too (a rank
                                         # killed by a signal takes them down within moments) before
                                         # the statuses are read for the outcome
    poll_s: float = 0.2                  # how often the statuses are read
    leftovers_grace_s: float | None = None   # ranks still running at the end: None: killed; else asked
                                             # to stop (SIGTERM), in rank order, waiting this long for each


def supervise(start: Callable[[], list], policy: Policy, on_poll: Callable[[], None] | None = None,
              on_forward: Callable[[int], None] | None = None) -> Outcome:
    """Start the ranks (`start()` returns their processes) with SIGINT/SIGTERM caught, watch them
    until the group ends, stop what still runs, and put the previous signal handlers back.
    `on_poll` runs at every look at the ranks; `on_forward(signal)` when a signal goes on to them."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig)) for sig in CAUGHT}
    try:
        procs = start()
        outcome = _watch(procs, policy, received, on_poll or (lambda: None), on_forward or (lambda sig: None))
        _stop_leftovers(procs, policy.leftovers_grace_s)
        return outcome
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(procs: list, policy: Policy, received: list[int], on_poll, on_forward) -> Outcome:
    forwarded = False
    while True:
        on_poll()
        if len(received) > 1 and policy.second_signal_aborts:      # asked again: do not wait
            return Outcome(Ending.ABORTED, tuple(exit_status(p) for p in procs), tuple(received))
        if received and not forwarded:
            forwarded = True
            sig = policy.forward or received[0]
            on_forward(sig)
            for p in procs:
                if exit_status(p) is None:
                    os.kill(p.pid, sig)
        codes = [exit_status(p) for p in procs]
        stopping = forwarded or any(c in STOPPED for c in codes)
        ended = all(c is not None for c in codes)
        if failed(codes) and (ended or not (stopping and policy.wait_out_failures)):
            if policy.settle_s and not ended:
                time.sleep(policy.settle_s)
                codes = [exit_status(p) for p in procs]
            return Outcome(Ending.FAILED, tuple(codes), tuple(received))
        if ended:
            ending = Ending.STOPPED if any(c in STOPPED for c in codes) else Ending.DONE
            return Outcome(ending, tuple(codes), tuple(received))
        time.sleep(policy.poll_s)


def _stop_leftovers(procs: list, grace_s: float | None) -> None:
    """Whatever still runs is not stopping by itself (a failed group, a second signal). Rank 0
    goes first: serving, it stops the pipeline in order (the stop travels down the stages)."""
    for p in procs:
        if exit_status(p) is None:
            if grace_s is None:
                p.kill()
            else:
                p.terminate()
                p.join(grace_s)
    if grace_s is None:
        for p in procs:
            p.join()


def forkserver(preload: str = "shardwise.worker.serving.rank", start: bool = False):
    """A fork server with torch and `preload` imported: children skip the multi-second import.
    The preload takes effect when the server starts: at the first child, or now with `start`, so
    that its import (seconds of torch) runs while this process imports and checks its inputs. A
    server started for inputs that turn out bad goes when this process exits. (Here, torch-free,
    so that a command can start it before importing anything heavy.)"""
    import multiprocessing as mp
    import multiprocessing.forkserver
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([preload])
    if start:
        multiprocessing.forkserver.ensure_running()
    return ctx


def stop_forkserver() -> None:
    """Stop the fork server started early for ranks that will not come (the inputs were bad), so
    that a caller reading this process's output to its end is not held up by the server's import
    (it shares the output). multiprocessing has no public call for it: its pid is read where the
    module keeps it, and nothing is done when that is gone."""
    import multiprocessing.forkserver
    pid = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None)
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
