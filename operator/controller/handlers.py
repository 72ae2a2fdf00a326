"""kopf handlers: thin wiring between watch events and the reconciler.

- One asyncio task per ShardedModel runs its reconcile loop (started when the model is first seen,
  also after an operator restart; stopped when it is deleted). Passes are serialized per model by
  construction; the blocking API calls run on a small thread pool.
- Pod events (pods labelled shardwise.dev/model) and node events (Ready flips, node added or gone)
  wake the loops concerned at once, so a lost node is acted on within seconds, not at the next tick.
- Two in-memory indexes fed by watches: nodes (the planner's inventory) and pods holding GPUs (what
  is allocated), so a reconcile costs few API requests however big the cluster is.

Nothing here is state the operator needs after a restart: each model's state is in its status.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Mapping

import kopf
import urllib3
from kubernetes.client.rest import ApiException

from shardwise.crds import names
from shardwise.crds.models import GROUP, PLURAL, VERSION
from shardwise.operator.controller import autoscaler, liveness, metrics
from shardwise.operator.decide import recovery
from shardwise.operator.controller import reconciler
from shardwise.operator.render import renderer
from shardwise.operator.controller.apply import Applier
from shardwise.operator.controller.leader import NotLeader
from shardwise.operator.planning.inventory import counted_node, pod_gpus

log = logging.getLogger("shardwise.operator")
DEBOUNCE_SECONDS = 0.2
# What a failed pass can meet that is not the model's fault nor a bug: the API server refusing or
# not answering (kopf's temporary errors). A bad spec is not among them: the reconciler reports it
# in status and waits for a new spec (kopf's permanent errors), and short capacity is retried by the
# pass itself.
TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)


class Capacity:
    """GPUs in use: pods seen by the watch plus pods this operator just created (the watch lags
    behind our own creates by a moment; without these, two models planned back to back could be
    given the same free GPUs). Planning holds `lock`, so plans are made one at a time."""

    RESERVATION_SECONDS = 60.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: dict[str, dict] = {}           # "ns/name" -> pod (nodeName = bound or planned)
        self.reserved: dict[str, tuple[float, dict]] = {}

    def sync(self, watched: dict[str, dict]) -> None:
        """The watch's current view; reservations it has caught up with are dropped."""
        self.watched = watched
        for key in list(self.reserved):
            if key in watched:
                self.reserved.pop(key, None)

    def reserve(self, pod: Mapping[str, Any], node: str) -> None:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        if key not in self.watched:
            self.reserved[key] = (time.monotonic(), _slim(pod, node))

    def pods(self, exclude: set[str]) -> list[dict]:
        """Live GPU pods, leaving out `exclude` ("ns/name"): the group being re-planned."""
        now = time.monotonic()
        for key, (since, _) in list(self.reserved.items()):
            if now - since > self.RESERVATION_SECONDS:
                self.reserved.pop(key, None)
        out = [p for k, p in list(self.watched.items()) if k not in exclude]
        out += [p for k, (_, p) in list(self.reserved.items()) if k not in exclude and k not in self.watched]
        return out


def _slim(pod: Mapping[str, Any], node: str | None) -> dict:
    """What allocation counting needs of a pod: its node (bound, or planned for our pending pods)
    and its containers' resources."""
    spec = pod.get("spec") or {}
    meta = pod["metadata"]
    labels = {k: v for k, v in (meta.get("labels") or {}).items()
              if k in (names.LABEL_MODEL, names.LABEL_REPLICA)}
    owners = [{k: ref.get(k) for k in ("apiVersion", "kind", "name", "uid", "controller")}
              for ref in meta.get("ownerReferences") or []]
    return {"metadata": {"name": meta["name"], "namespace": meta.get("namespace"), "labels": labels,
                         "ownerReferences": owners},
            "spec": {"nodeName": node,
                     "containers": [{"resources": c.get("resources") or {}} for c in spec.get("containers") or []]},
            "status": {"phase": (pod.get("status") or {}).get("phase")}}


class Wiring:
    """Process-wide wiring of the handlers, configured by `shardwise operator run` before kopf starts:
    the applier and the worker image, the thread pool passes run on, the GPU capacity view, the nodes'
    readiness, each model's loop task and its waker, and the counters of passes and requests."""

    def __init__(self) -> None:
        self.applier: Applier | None = None
        self.default_image = renderer.DEFAULT_IMAGE
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="reconcile")
        self.capacity = Capacity()
        self.node_ready: dict[str, bool] = {}
        self.wakers: dict[tuple[str, str], asyncio.Event] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.autoscaler = autoscaler.Autoscaler()
        self.scalers: dict[tuple[str, str], asyncio.Task] = {}    # models with spec.autoscaling
        self.reconciles = 0
        self.requests = 0
        self.liveness = liveness.Liveness()     # when each loop last completed a pass (/healthz)

    def waker(self, key: tuple[str, str]) -> asyncio.Event:
        return self.wakers.setdefault(key, asyncio.Event())

    def wake(self, key: tuple[str, str] | None = None) -> None:
        for k, event in list(self.wakers.items()):
            if key is None or k == key:
                event.set()


WIRING = Wiring()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Status is ours; kopf keeps its bookkeeping in annotations, not in our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.KOPF_ANNOTATION_PREFIX)
    if WIRING.applier is None:
        WIRING.applier = Applier()


# --- watches that feed the in-memory views -------------------------------------------------------
# kopf lists every indexed resource before any other handler runs, so the first reconcile after a
# start already sees every node and every GPU pod (a half-filled inventory would make a node look
# "gone" and start a needless recovery).

@kopf.index("", "v1", "nodes")
def nodes_index(name: str, body: kopf.Body, **_: Any) -> dict:
    return {name: {"metadata": {"name": name, "labels": dict(body.metadata.labels or {}),
                                **({"deletionTimestamp": body.metadata.deletion_timestamp}
                                   if body.metadata.deletion_timestamp else {})},
                   "spec": dict(body.spec), "status": {"allocatable": dict(body.status.get("allocatable") or {}),
                                                       "capacity": dict(body.status.get("capacity") or {}),
                                                       "conditions": list(body.status.get("conditions") or [])}}}


@kopf.index("", "v1", "pods")
def gpu_pods_index(namespace: str, name: str, body: kopf.Body, labels: Mapping[str, str], **_: Any) -> dict:
    """Pods that hold GPUs (or will: ours, pinned but not bound yet), by "ns/name". A pending pod
    counts only when the operator made it (inventory.counted_node)."""
    phase = (body.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        return {}
    pod = {"metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                        "annotations": dict(body.metadata.annotations or {}),
                        "ownerReferences": list(body.metadata.get("ownerReferences") or [])},
           "spec": dict(body.spec), "status": {"phase": phase}}
    node = counted_node(pod)
    if not node or not (names.LABEL_MODEL in labels or pod_gpus(pod)):
        return {}
    return {f"{namespace}/{name}": _slim(pod, node)}


@kopf.on.event("", "v1", "nodes")
def node_event(type: str, name: str, body: kopf.Body, **_: Any) -> None:
    ready = type != "DELETED" and recovery.node_ready(body)
    was = WIRING.node_ready.get(name)
    if type == "DELETED":
        WIRING.node_ready.pop(name, None)
    else:
        WIRING.node_ready[name] = ready
    if was != ready or type == "DELETED":
        # A node lost: groups on it recover; a node gained: Pending groups may fit now.
        WIRING.wake()


@kopf.on.event("", "v1", "pods", labels={names.LABEL_MODEL: kopf.PRESENT})
def pod_event(namespace: str, labels: Mapping[str, str], **_: Any) -> None:
    WIRING.wake((namespace, labels[names.LABEL_MODEL]))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def model_event(type: str, namespace: str, name: str, body: kopf.Body, logger: logging.Logger,
                      nodes_index: kopf.Index, gpu_pods_index: kopf.Index, **_: Any) -> None:
    """Starts a model's reconcile loop when the model is first seen (created, or listed after an
    operator start), stops it when the model is gone, and wakes it on a spec change (a new
    generation, e.g. `kubectl scale`); our own status writes do not wake it.

    A plain task per model rather than a kopf daemon: daemons need a finalizer on every object, which
    would make deleting a ShardedModel wait for a running operator. Without one, deletion is plain
    garbage collection through the ownerReferences."""
    key = (namespace, name)
    _autoscale(key, body, type, logger)
    if type == "DELETED" or body.metadata.get("deletionTimestamp"):
        task = WIRING.tasks.pop(key, None)
        if task is not None:
            task.cancel()
        WIRING.wakers.pop(key, None)
        metrics.forget(namespace, name)
        return
    task = WIRING.tasks.get(key)
    if task is None or task.done():
        ref = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
               "metadata": {"name": name, "namespace": namespace, "uid": body.metadata.uid}}
        WIRING.tasks[key] = asyncio.create_task(model_loop(namespace, name, ref, logger, nodes_index,
                                                            gpu_pods_index), name=f"reconcile {namespace}/{name}")
    elif body.metadata.get("generation") != (body.get("status") or {}).get("observedGeneration"):
        WIRING.wake(key)


# --- the per-model autoscaling loop (controller/autoscaler.py) -----------------------------------
# A plain task, as the reconcile loop is (a kopf timer would need a finalizer on every model); it
# runs while the model has spec.autoscaling and stops when it is removed or the model is gone.

def _autoscale(key: tuple[str, str], body: kopf.Body, type: str, logger: logging.Logger) -> None:
    wanted = type != "DELETED" and not body.metadata.get("deletionTimestamp") and bool(body.spec.get("autoscaling"))
    task = WIRING.scalers.get(key)
    if wanted and (task is None or task.done()):
        ref = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
               "metadata": {"name": key[1], "namespace": key[0], "uid": body.metadata.uid}}
        WIRING.scalers[key] = asyncio.create_task(autoscale_loop(*key, ref, logger), name=f"autoscale {key[0]}/{key[1]}")
    elif not wanted and task is not None:
        WIRING.scalers.pop(key, None)
        task.cancel()


async def autoscale_loop(namespace: str, name: str, ref: dict, logger: logging.Logger) -> None:
    loop, failures = asyncio.get_running_loop(), 0
    while True:
        try:
            events, period = await loop.run_in_executor(WIRING.executor, WIRING.autoscaler.run, WIRING.applier,
                                                        namespace, name)
            failures = 0
        except (NotLeader, *TRANSIENT) as e:
            failures += 1
            logger.warning(f"autoscaling pass failed ({type(e).__name__}); retrying")
            events, period = [], _backoff(failures)
        except Exception:  # a bug: say where, keep the model's replicas as they are, retry
            failures += 1
            logger.exception("autoscaling pass failed unexpectedly; retrying")
            events, period = [], _backoff(failures)
        for ev in events:
            kopf.event(ref, type=ev.type, reason=ev.reason, message=ev.message[:1000])
        if period is None:
            WIRING.scalers.pop((namespace, name), None)
            return
        await asyncio.sleep(period)


# --- the per-model reconcile loop ------------------------------------------------------------------

async def model_loop(namespace: str, name: str, ref: dict, logger: logging.Logger, nodes_index: kopf.Index,
                     gpu_pods_index: kopf.Index) -> None:
    key = (namespace, name)
    wake = WIRING.waker(key)
    loop = asyncio.get_running_loop()
    failures = 0
    WIRING.liveness.completed(key)
    try:
        while True:
            wake.clear()
            # Snapshots taken here, on the event loop that updates the indexes, are consistent.
            nodes = {k: v for k, store in nodes_index.items() for v in store}
            WIRING.capacity.sync({k: v for k, store in gpu_pods_index.items() for v in store})
            try:
                outcome = await loop.run_in_executor(WIRING.executor, _reconcile_once, namespace, name, nodes)
                failures = 0
            except NotLeader as e:  # the lease ran out (leader.py): the process is stepping down
                failures += 1
                logger.warning(str(e))
                outcome = reconciler.Outcome(requeue_after=_backoff(failures))
            except TRANSIENT as e:  # an API hiccup must not kill the loop; back off and retry
                failures += 1
                logger.warning(f"reconcile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                               f"retrying")
                outcome = reconciler.Outcome(requeue_after=_backoff(failures))
            except Exception:  # a bug: say where, keep the other models going, retry the same way
                failures += 1
                logger.exception("reconcile failed unexpectedly; retrying")
                outcome = reconciler.Outcome(requeue_after=_backoff(failures))
            WIRING.liveness.completed(key)
            for ev in outcome.events:
                kopf.event(ref, type=ev.type, reason=ev.reason, message=ev.message[:1000])
            try:
                await asyncio.wait_for(wake.wait(), timeout=outcome.requeue_after)
                # A pod's start is a burst of events (bound, running, ready): let it settle so that
                # one pass sees them all.
                await asyncio.sleep(DEBOUNCE_SECONDS)
            except asyncio.TimeoutError:
                pass
    finally:
        WIRING.liveness.forget(key)
        if WIRING.wakers.get(key) is wake:
            WIRING.wakers.pop(key, None)


def _backoff(failures: int) -> float:
    return min(30.0, 0.5 * 2 ** failures)


def _reconcile_once(namespace: str, name: str, nodes: dict[str, dict]) -> reconciler.Outcome:
    assert WIRING.applier is not None
    outcome = reconciler.reconcile(WIRING.applier, namespace, name, nodes, WIRING.capacity,
                                   default_image=WIRING.default_image)
    WIRING.reconciles += 1
    WIRING.requests += outcome.requests
    return outcome
