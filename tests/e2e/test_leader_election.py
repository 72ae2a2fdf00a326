"""Leader election's pieces against the real local control plane (a real Lease, a real ShardedModel),
driven from this process so each step is deterministic. The whole operator with its leader frozen
for 20 s is in test_operator.py (test_a_leader_frozen_for_20_s_...).

- A standby leaves a Lease alone while its holder keeps renewing it, however old the renewTime the
  holder writes looks (its clock an hour behind ours), and takes it a lease duration after the
  renewals stop.
- A status patch made from a read older than another writer's status is refused (409), and the
  newer status is what stays stored.
"""
from __future__ import annotations

import datetime as dt
import time

import pytest
from kubernetes import client

from shardwise.crds.schema import CRD_FILE
from shardwise.e2e.pytest_plugin import wait_until
from shardwise.operator.controller.apply import Applier, StaleStatus
from shardwise.operator.controller.leader import LeaseLock, lease_client

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(120)]


def _lease(namespace: str, holder: str, renewed: dt.datetime) -> client.V1Lease:
    return client.V1Lease(metadata=client.V1ObjectMeta(name="shardwise-operator", namespace=namespace),
                          spec=client.V1LeaseSpec(holder_identity=holder, lease_duration_seconds=3,
                                                  acquire_time=renewed, renew_time=renewed, lease_transitions=0))


def test_a_standby_leaves_alone_a_lease_renewed_by_a_holder_whose_clock_is_an_hour_behind(kube_api, namespace):
    coord = client.CoordinationV1Api(kube_api)
    behind = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    coord.create_namespaced_lease(namespace, _lease(namespace, "skewed-leader", behind))
    standby = LeaseLock(lease_client(kube_api.configuration), namespace, lease_seconds=3, renew_seconds=1,
                        who="standby")
    started = time.monotonic()
    while time.monotonic() - started < 7:              # more than two lease durations of renewals
        lease = coord.read_namespaced_lease("shardwise-operator", namespace)
        lease.spec.renew_time = behind + dt.timedelta(seconds=time.monotonic() - started)
        coord.replace_namespaced_lease("shardwise-operator", namespace, lease)
        assert not standby.try_acquire(), "the standby took a lease its holder was renewing"
        time.sleep(0.5)
    # The holder stops renewing: a lease duration of the standby's clock later, it is the standby's.
    stopped = time.monotonic()
    wait_until(standby.try_acquire, 10, "the standby to take the lease", interval=0.2)
    took = time.monotonic() - stopped
    lease = coord.read_namespaced_lease("shardwise-operator", namespace)
    assert lease.spec.holder_identity == "standby" and lease.spec.lease_transitions == 1
    assert 2.5 <= took <= 5, f"taken {took:.1f}s after the last renewal (lease: 3s)"
    assert standby.holds()


def test_a_status_patch_from_a_stale_read_is_refused_and_the_newer_status_kept(cluster, kube_api, namespace):
    cluster.install_crd(CRD_FILE)
    cluster.kubectl("apply", "-f", "-", namespace=namespace, input=(
        '{"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},'
        ' "spec": {"model": {"uri": "/models/m", "parameters": 1000000000, "layers": 16, "heads": 16},'
        ' "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1}}}'))
    old_leader, new_leader = Applier(kube_api), Applier(kube_api)
    stale = old_leader.get_model(namespace, "m")["metadata"]["resourceVersion"]   # read, then frozen
    fresh = new_leader.get_model(namespace, "m")["metadata"]["resourceVersion"]
    stored = new_leader.patch_status(namespace, "m", {"message": "written by the new leader"}, fresh)
    assert stored["metadata"]["resourceVersion"] != fresh
    with pytest.raises(StaleStatus, match=f"ShardedModel {namespace}/m changed since it was read"):
        old_leader.patch_status(namespace, "m", {"message": "written by the old leader"}, stale)
    assert new_leader.get_model(namespace, "m")["status"]["message"] == "written by the new leader"
    # The version the new leader's write returned is the one its next write is conditional on.
    again = new_leader.patch_status(namespace, "m", {"message": "again"}, stored["metadata"]["resourceVersion"])
    assert again["status"]["message"] == "again"


def test_a_pass_whose_status_write_meets_a_newer_one_ends_quietly_and_is_redone(cluster, kube_api, namespace,
                                                                                caplog):
    """A real reconcile pass; between its read and its status write another writer (a newer leader,
    here this test) writes status. The pass's write is refused, the pass ends in one log line and a
    short requeue instead of an error, and the next pass, from a fresh read, writes."""
    from shardwise.operator.controller import handlers, reconciler

    cluster.install_crd(CRD_FILE)
    cluster.kubectl("apply", "-f", "-", namespace=namespace, input=(
        '{"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "m"},'
        ' "spec": {"model": {"uri": "/models/m", "parameters": 1000000000, "layers": 16, "heads": 16},'
        ' "parallelism": {"tensor": 1, "pipeline": 1, "replicas": 1},'
        ' "placement": {"nodeSelector": {"shardwise.dev/test": "no-such-node"}}}}'))
    applier, newer = Applier(kube_api), Applier(kube_api)
    writes = []

    def newer_leader_writes_first() -> None:       # the fence runs before each of the pass's writes
        writes.append(True)
        if len(writes) == 1:
            rv = newer.get_model(namespace, "m")["metadata"]["resourceVersion"]
            newer.patch_status(namespace, "m", {"message": "written by the new leader"}, rv)
    applier.fence = newer_leader_writes_first
    with caplog.at_level("INFO", logger="shardwise.operator"):
        out = reconciler.reconcile(applier, namespace, "m", {}, handlers.Capacity())
    assert out.requeue_after == reconciler.STALE_REQUEUE
    assert applier.get_model(namespace, "m")["status"]["message"] == "written by the new leader"
    said = [r.getMessage() for r in caplog.records if "changed since it was read" in r.getMessage()]
    assert said == [f"ShardedModel {namespace}/m changed since it was read; reading it again"]
    assert not [r for r in caplog.records if r.exc_info]
    # The next pass reads the newer status and writes its own on top of it.
    out = reconciler.reconcile(applier, namespace, "m", {}, handlers.Capacity())
    assert out.requeue_after != reconciler.STALE_REQUEUE and out.phase == "Pending"
    assert applier.get_model(namespace, "m")["status"]["phase"] == "Pending"
