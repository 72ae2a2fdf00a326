"""How `shardwise train` (a local launch) and a pod (`shardwise worker`) watch their ranks, with
stand-in rank processes that exit, fail, get killed or stop on a signal: worker/distributed/launch.py
with each command's policy, and the exit status each command makes of the outcome."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from shardwise.worker.cli import train
from shardwise.worker.cli.pod import POD_GROUP
from shardwise.worker.distributed.launch import STOPPED, Ending, Exit, supervise

mp = multiprocessing.get_context("fork")


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def _stop_on_sigterm(delay: float, code: int) -> None:
    """A rank that, on SIGTERM or SIGINT, takes `delay` (its checkpoint) and exits `code`."""
    got = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: got.append(s))
    while not got:
        time.sleep(0.01)
    time.sleep(delay)
    os._exit(code)


def _deaf() -> None:
    """A rank that ignores the signals and never ends by itself."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(0.05)


def _ranks(*targets):
    """A start() for supervise: one process per (function, args)."""
    def start():
        procs = [mp.Process(target=fn, args=args) for fn, args in targets]
        for p in procs:
            p.start()
        return procs
    return start


def _signal_me(after: float, *sigs: int) -> None:
    def send():
        for sig in sigs:
            time.sleep(after)
            os.kill(os.getpid(), sig)
    threading.Thread(target=send, daemon=True).start()


def test_the_exit_table():
    assert (Exit.OK, Exit.FAILED, Exit.BAD_INPUT) == (0, 1, 2)
    assert STOPPED == {130, 143} == {128 + signal.SIGINT, 128 + signal.SIGTERM}


def test_all_done_is_zero():
    outcome = supervise(_ranks((_exit_after, (0.1, 0)), (_exit_after, (0.3, 0))), train.LOCAL_GROUP)
    assert outcome.ending is Ending.DONE and train.status_of(outcome) == 0


def test_a_failed_rank_stops_the_others_and_its_status_is_the_commands():
    began = time.monotonic()
    outcome = supervise(_ranks((_deaf, ()), (_exit_after, (0.1, 2))), train.LOCAL_GROUP)
    assert outcome.ending is Ending.FAILED and train.status_of(outcome) == 2
    assert time.monotonic() - began < 5          # the deaf rank was killed, not waited for


def test_a_rank_killed_by_a_signal_is_named_as_the_cause(capsys):
    def start():
        procs = _ranks((_deaf, ()), (_deaf, ()))()
        threading.Timer(0.2, os.kill, (procs[1].pid, signal.SIGKILL)).start()
        return procs
    assert train.status_of(supervise(start, train.LOCAL_GROUP)) == 1
    assert "rank 1 was killed by signal 9; stopping the other ranks" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_goes_on_to_the_ranks_and_the_launch_exits_with_their_stop_status(sig):
    before = signal.getsignal(sig)
    _signal_me(0.3, sig)
    outcome = supervise(_ranks((_stop_on_sigterm, (0.2, 128 + sig)), (_stop_on_sigterm, (0.1, 128 + sig))),
                        train.LOCAL_GROUP)
    assert outcome.ending is Ending.STOPPED and train.status_of(outcome) == 128 + sig
    assert signal.getsignal(sig) is before        # the handlers the command had come back


def test_a_second_signal_stops_the_local_ranks_at_once():
    _signal_me(0.3, signal.SIGINT, signal.SIGINT)
    began = time.monotonic()
    outcome = supervise(_ranks((_deaf, ()), (_deaf, ())), train.LOCAL_GROUP)
    assert outcome.ending is Ending.ABORTED and train.status_of(outcome) == 130
    assert time.monotonic() - began < 5


def test_a_pod_forwards_sigterm_whatever_it_got_and_waits_for_every_rank_while_they_stop():
    _signal_me(0.3, signal.SIGINT)
    began = time.monotonic()
    # rank 0 takes a second to save; rank 1 fails at once: the pod still waits for rank 0
    outcome = supervise(_ranks((_stop_on_sigterm, (1.0, 143)), (_stop_on_sigterm, (0.0, 1))), POD_GROUP)
    assert outcome.ending is Ending.FAILED and outcome.failed == [(1, 1)]
    assert outcome.codes == (143, 1) and time.monotonic() - began >= 1.0


def test_a_pod_stopped_by_a_signal_is_stopped_and_a_failure_outside_a_stop_ends_the_wait():
    _signal_me(0.3, signal.SIGTERM)
    outcome = supervise(_ranks((_stop_on_sigterm, (0.1, 143)), (_stop_on_sigterm, (0.0, 0))), POD_GROUP)
    assert outcome.ending is Ending.STOPPED
    began = time.monotonic()
    outcome = supervise(_ranks((_stop_on_sigterm, (0.0, 143)), (_exit_after, (0.1, 1))), POD_GROUP)
    assert outcome.ending is Ending.FAILED and outcome.failed == [(1, 1)]
    assert time.monotonic() - began < 5          # rank 0 asked to stop (SIGTERM), not waited for
