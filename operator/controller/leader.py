"""Leader election on a coordination.k8s.io Lease, so two operator replicas run safely: one reconciles,
the other waits and takes over about `lease_seconds` after the leader stops renewing.

Why a Lease of our own and not kopf peering: peering needs its own cluster-wide CRDs and lets every
replica run while pausing the others, whereas a Lease is a built-in object, needs only get/create/update
on one Lease in the operator's namespace (what the chart's Role grants), and is what every
controller-runtime operator does.

Time is judged only by each replica's own monotonic clock, never by comparing a timestamp another
node wrote with this node's wall clock (the nodes' clocks may disagree by minutes):
- A standby (the `Observer`) notes when it last saw the Lease record change (holder, renewTime,
  acquireTime, transitions). The lease is expired when it has not changed for leaseDurationSeconds
  of the standby's own clock, as client-go judges it. A standby that has just started therefore
  waits a whole lease duration before taking a lease it finds held.
- The leader (the `Tenure`) counts from the moment it sent its last successful renewal (the server
  wrote it later, so a standby saw it later still) and holds the lease for `lease_seconds -
  renew_seconds` of its own clock after that. It renews every `renew_seconds`; when it cannot renew
  before that deadline, or finds the Lease taken, it steps down (the process exits and the Deployment
  restarts it as a standby).

Lease requests go through their own ApiClient (not the applier's: a reconcile that fills or wedges
the applier's connections cannot delay a renewal), each with a request timeout of half the renew
period and no retries, so one renewal attempt (a read and a write) ends within one renew period and
a hung API connection cannot keep a stale leader believing it leads.

Fencing the writes of a leader that was frozen (SIGSTOP, a VM pause, a long GC) and resumes after a
standby took over, in two layers:
- `LeaseLock.check()` runs before every write the applier makes (applier.fence): when the leader's
  own clock says the tenure has run out it steps down and the write is not sent.
- A write already past that check when the process froze is still sent on resume. The one that could
  clobber a newer leader's work is the ShardedModel's status (its group records, attempt numbers and
  restart counts), so status patches carry the resourceVersion the pass read (apply.py): the API
  server refuses (409) a patch to an object a newer leader has written since, and the pass is read
  again. We chose the resourceVersion precondition over a fencing token (the Lease's
  leaseTransitions recorded at election and written into status): it is enforced atomically by the
  API server on the very object written, needs no field in the status schema and no extra read of
  the Lease per write, and also turns a status write racing a spec edit into a re-read instead of a
  decision made on the old spec. Pod creates need no fence (names carry the group's attempt, so a
  stale create meets the pod or makes one the new leader deletes); a stale pod delete in that one
  in-flight request is the remaining window (docs/security.md).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("shardwise.operator.controller.leader")

Clock = Callable[[], float]


class NotLeader(Exception):
    """This replica does not hold the Lease (any more): the write was not sent. str(): one line."""


def identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def lease_client(configuration: client.Configuration) -> client.ApiClient:
    """An ApiClient of the Lease's own: a copy of the applier's configuration (same server and
    credentials) with its own two connections and no urllib3 retries (a retry would restart the
    request timeout, and the renew loop retries on its own schedule)."""
    own = copy.deepcopy(configuration)
    own.retries = False
    own.connection_pool_maxsize = 2
    return client.ApiClient(own)


@dataclasses.dataclass
class Observer:
    """A standby's view of the Lease: the record it last saw and when, by its own clock."""

    record: tuple[Any, ...] | None = None
    seen_at: float = 0.0

    def see(self, record: tuple[Any, ...], now: float) -> None:
        if record != self.record:
            self.record, self.seen_at = record, now

    def expired(self, now: float, lease_seconds: float) -> bool:
        """Unchanged for a whole lease duration of this observer's clock (never seen: not expired)."""
        return self.record is not None and now - self.seen_at >= lease_seconds


@dataclasses.dataclass
class Tenure:
    """The leader's own view: when its last successful renewal was sent, by its own clock."""

    valid_seconds: float
    renewed_at: float | None = None

    def renewed(self, sent_at: float) -> None:
        self.renewed_at = sent_at

    def holds(self, now: float) -> bool:
        return self.renewed_at is not None and now - self.renewed_at < self.valid_seconds


def record_of(spec: client.V1LeaseSpec) -> tuple[Any, ...]:
    """What must change for an observer to count the lease as renewed."""
    return (spec.holder_identity, spec.renew_time, spec.acquire_time, spec.lease_transitions)


class LeaseLock:
    def __init__(self, api: client.ApiClient, namespace: str, name: str = "shardwise-operator",
                 lease_seconds: int = 15, renew_seconds: float = 5.0, who: str | None = None,
                 clock: Clock = time.monotonic):
        """`api`: the Lease's own client (lease_client()), not the applier's."""
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name = namespace, name
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self.timeout = renew_seconds / 2      # per request: a read and a write fit in a renew period
        self.who = who or identity()
        self.clock = clock
        self.observer = Observer()
        self.tenure = Tenure(valid_seconds=lease_seconds - renew_seconds)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._on_lost: Callable[[], None] = lambda: None

    # --- one attempt -----------------------------------------------------------------------------

    def try_acquire(self) -> bool:
        """One attempt: take the Lease if it is free, expired (by our clock) or already ours."""
        sent_at = self.clock()
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status != 404:
                raise
            return self._create(sent_at)
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity
        self.observer.see(record_of(spec), self.clock())
        mine = holder == self.who
        if holder and not mine and not self.observer.expired(self.clock(), spec.lease_duration_seconds
                                                             or self.lease_seconds):
            return False
        now = dt.datetime.now(dt.timezone.utc)   # written for people reading the Lease, never compared
        acquired = spec.acquire_time if mine and spec.acquire_time else now
        lease.spec = self._spec(acquired, now, (spec.lease_transitions or 0) + (0 if mine else 1))
        # The resourceVersion in `lease` makes this a compare-and-swap: two takers, one wins.
        return self._claim(sent_at, lambda: self.coord.replace_namespaced_lease(
            self.name, self.namespace, lease, _request_timeout=self.timeout))

    def _create(self, sent_at: float) -> bool:
        now = dt.datetime.now(dt.timezone.utc)
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                              spec=self._spec(now, now, transitions=0))
        return self._claim(sent_at, lambda: self.coord.create_namespaced_lease(
            self.namespace, body, _request_timeout=self.timeout))

    def _claim(self, sent_at: float, write: Callable[[], Any]) -> bool:
        """One write that takes or renews the Lease; False when another writer got there first (409)."""
        try:
            write()
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self.tenure.renewed(sent_at)
        return True

    def _spec(self, acquired: dt.datetime, renewed: dt.datetime, transitions: int) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(holder_identity=self.who, lease_duration_seconds=self.lease_seconds,
                                  acquire_time=acquired, renew_time=renewed, lease_transitions=transitions)

    # --- the fence -------------------------------------------------------------------------------

    def holds(self) -> bool:
        return not self._lost.is_set() and self.tenure.holds(self.clock())

    def check(self) -> None:
        """Before every write: raise NotLeader (and step down) unless the tenure is still running."""
        if not self.holds():
            self._step_down("the lease was not renewed in time (this process may have been paused)")
            raise NotLeader(f"not the leader of lease {self.namespace}/{self.name} any more; write not sent")

    def _step_down(self, why: str) -> None:
        if not self._lost.is_set():
            self._lost.set()
            log.error(f"{why}; stepping down")
            self._on_lost()

    # --- loops -----------------------------------------------------------------------------------

    def wait_until_leader(self, progress: bool = True) -> None:
        announced = False
        while not self._stop.is_set():
            held_by_other = False
            try:
                if self.try_acquire():
                    log.info(f"leader: {self.who} holds lease {self.namespace}/{self.name}")
                    return
                held_by_other = True
            except ApiException as e:
                log.warning(f"lease {self.namespace}/{self.name}: {e.status} {e.reason}")
            except Exception as e:  # API server unreachable or slow: say so in one line and keep trying
                log.warning(f"lease {self.namespace}/{self.name}: cannot reach the API server "
                            f"({type(e).__name__}); retrying")
            if progress and held_by_other and not announced:
                log.info(f"standby: another operator holds lease {self.namespace}/{self.name}; waiting")
                announced = True
            self._stop.wait(self.renew_seconds / 2)

    def keep_renewing(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in the background; call `on_lost()` (once) when the lease was taken or could not be
        renewed in time, or when check() finds the tenure run out."""
        self._on_lost = on_lost
        thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        thread.start()
        return thread

    def _renew_loop(self) -> None:
        pause = self.renew_seconds
        while not self._stop.wait(pause) and not self._lost.is_set():
            # First the deadline: a leader that was paused past it must not renew and lead on, its
            # standby may have taken over meanwhile.
            if not self.tenure.holds(self.clock()):
                self._step_down("could not renew the lease in time")
                return
            try:
                if not self.try_acquire():
                    self._step_down(f"lease {self.namespace}/{self.name} was taken by another operator")
                    return
                pause = self.renew_seconds
            except Exception as e:  # API unreachable or slow: try again sooner, until the deadline
                log.warning(f"renewing lease {self.namespace}/{self.name} failed ({type(e).__name__}); "
                            f"retrying")
                pause = self.renew_seconds / 2

    def release(self) -> None:
        """Give the lease up on a clean shutdown, so the standby takes over at once."""
        self._stop.set()
        if not self.holds():
            return
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.timeout)
            if lease.spec.holder_identity == self.who:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                self.coord.replace_namespaced_lease(self.name, self.namespace, lease,
                                                    _request_timeout=self.timeout)
        except Exception as e:
            log.warning(f"releasing lease {self.namespace}/{self.name} failed ({type(e).__name__})")
