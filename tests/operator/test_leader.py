"""Leader election's judgement of time (controller/leader.py), by each replica's own clock only.

A standby counts a lease expired when it has not seen the Lease record change for a whole lease
duration of its own clock, whatever renewTime the holder wrote (clocks of two nodes may disagree by
minutes); the leader holds for `lease - renew` seconds of its own clock after its last successful
renewal was sent, so it stops writing before any standby can count the lease expired.
"""
from __future__ import annotations

import datetime as dt

from kubernetes import client

from shardwise.operator.controller.leader import LeaseLock, NotLeader, Observer, Tenure, record_of

HOUR_AGO = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)


def record(holder: str, renewed: dt.datetime, transitions: int = 1) -> tuple:
    return record_of(client.V1LeaseSpec(holder_identity=holder, renew_time=renewed, acquire_time=HOUR_AGO,
                                        lease_transitions=transitions, lease_duration_seconds=15))


def test_a_lease_that_keeps_changing_never_expires_however_old_its_renew_time_looks():
    # The holder's clock is years behind ours: each renewTime it writes looks long expired to a wall
    # clock, yet it renews every 5 s, which is all the standby counts.
    seen = Observer()
    for i in range(10):
        seen.see(record("a", HOUR_AGO + dt.timedelta(seconds=5 * i)), now=100.0 + 5 * i)
        assert not seen.expired(now=100.0 + 5 * i + 4.9, lease_seconds=15)


def test_a_lease_expires_after_a_whole_duration_unchanged_by_the_observers_clock():
    seen = Observer()
    future = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)  # a holder whose clock runs ahead
    seen.see(record("a", future), now=50.0)
    seen.see(record("a", future), now=60.0)          # the same record again: not a renewal
    assert not seen.expired(now=64.9, lease_seconds=15)
    assert seen.expired(now=65.0, lease_seconds=15)


def test_a_standby_that_just_started_waits_a_whole_duration_before_taking_a_held_lease():
    seen = Observer()
    assert not seen.expired(now=1000.0, lease_seconds=15)      # nothing seen yet
    seen.see(record("a", HOUR_AGO), now=1000.0)                  # first sight: counted from now
    assert not seen.expired(now=1014.0, lease_seconds=15)
    assert seen.expired(now=1015.0, lease_seconds=15)


def test_a_new_holder_or_transition_counts_as_a_change():
    seen = Observer()
    seen.see(record("a", HOUR_AGO, 1), now=0.0)
    seen.see(record("b", HOUR_AGO, 2), now=14.0)
    assert not seen.expired(now=20.0, lease_seconds=15)


def test_the_leader_stops_holding_a_renew_period_before_a_standby_can_take_over():
    tenure = Tenure(valid_seconds=15 - 5)
    assert not tenure.holds(now=0.0)                  # never renewed
    tenure.renewed(sent_at=100.0)
    assert tenure.holds(now=109.9)
    assert not tenure.holds(now=110.0)                # a standby that saw the renewal needs until 115


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_paused_leader_refuses_to_write_and_steps_down_once():
    # check() is the applier's fence: after a pause past the deadline no write is sent, and the
    # step-down callback runs once however many writes were about to be made.
    clock, lost = _Clock(), []
    lock = LeaseLock(client.ApiClient(client.Configuration()), "ns", lease_seconds=6, renew_seconds=2,
                     who="me", clock=clock)
    lock._on_lost = lambda: lost.append(True)
    lock.tenure.renewed(clock())
    lock.check()
    clock.now = 3.9
    lock.check()
    clock.now = 20.0                                   # frozen for 20 s
    for _ in range(3):
        try:
            lock.check()
        except NotLeader as e:
            assert "not the leader" in str(e) and "\n" not in str(e)
        else:
            raise AssertionError("a leader past its deadline was let write")
    assert lost == [True]
    assert not lock.holds()
