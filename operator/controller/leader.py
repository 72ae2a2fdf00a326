"""Leader election on a coordination.k8s.io Lease, so two operator replicas run safely: one reconciles,
the other waits and takes over within about `lease_seconds` of the leader vanishing.

Why a Lease of our own and not kopf peering: peering needs its own cluster-wide CRDs and lets every
replica run while pausing the others, whereas a Lease is a built-in object, needs only get/create/update
on one Lease in the operator's namespace (what the chart's Role grants), and is what every
controller-runtime operator does. The leader renews every `renew_seconds`; if it cannot renew before the
lease expires it exits at once (the Deployment restarts it as a standby), so two leaders never overlap
for longer than one renew period.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("shardwise.operator.controller.leader")


def identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class LeaseLock:
    def __init__(self, api: client.ApiClient, namespace: str, name: str = "shardwise-operator",
                 lease_seconds: int = 15, renew_seconds: float = 5.0, who: str | None = None):
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name = namespace, name
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self.who = who or identity()
        self._stop = threading.Event()

    def try_acquire(self) -> bool:
        """One attempt: take the Lease if it is free, expired or already ours."""
        now = _now()
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                  spec=self._spec(now, now, transitions=0))
            try:
                self.coord.create_namespaced_lease(self.namespace, body)
                return True
            except ApiException as e2:
                if e2.status == 409:
                    return False
                raise
        spec = lease.spec
        holder = spec.holder_identity
        renewed = spec.renew_time or spec.acquire_time
        expired = renewed is None or (now - renewed).total_seconds() > (spec.lease_duration_seconds or self.lease_seconds)
        if holder and holder != self.who and not expired:
            return False
        acquired = spec.acquire_time if holder == self.who and spec.acquire_time else now
        transitions = (spec.lease_transitions or 0) + (0 if holder == self.who else 1)
        lease.spec = self._spec(acquired, now, transitions)
        try:
            # The resourceVersion in `lease` makes this a compare-and-swap: two takers, one wins.
            self.coord.replace_namespaced_lease(self.name, self.namespace, lease)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    def _spec(self, acquired: dt.datetime, renewed: dt.datetime, transitions: int) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(holder_identity=self.who, lease_duration_seconds=self.lease_seconds,
                                  acquire_time=acquired, renew_time=renewed, lease_transitions=transitions)

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
            except Exception as e:  # API server unreachable: say so in one line and keep trying
                log.warning(f"lease {self.namespace}/{self.name}: cannot reach the API server "
                            f"({type(e).__name__}); retrying")
            if progress and held_by_other and not announced:
                log.info(f"standby: another operator holds lease {self.namespace}/{self.name}; waiting")
                announced = True
            self._stop.wait(self.renew_seconds / 2)

    def keep_renewing(self, on_lost) -> threading.Thread:
        """Renew in the background; call `on_lost()` when the lease could not be renewed in time."""
        def loop() -> None:
            last_ok = time.monotonic()
            while not self._stop.wait(self.renew_seconds):
                try:
                    if self.try_acquire():
                        last_ok = time.monotonic()
                        continue
                    log.error(f"lease {self.namespace}/{self.name} was taken by another operator")
                    on_lost()
                    return
                except Exception as e:  # API unreachable: keep trying until the lease would expire
                    log.warning(f"renewing lease failed: {e}")
                if time.monotonic() - last_ok > self.lease_seconds - self.renew_seconds:
                    log.error("could not renew the lease in time; stepping down")
                    on_lost()
                    return
        thread = threading.Thread(target=loop, name="lease-renew", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Give the lease up on a clean shutdown, so the standby takes over at once."""
        self._stop.set()
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity == self.who:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                self.coord.replace_namespaced_lease(self.name, self.namespace, lease)
        except Exception as e:
            log.warning(f"releasing lease: {e}")
