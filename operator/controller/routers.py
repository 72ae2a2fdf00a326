"""The model's router (render/router.py), kept in step with the spec and the Ready replicas: its
objects applied when spec.serving.router is enabled, its replicas file rewritten when the set of
Ready stage-0 pods changes, and all of it deleted (the serving Service pointed back at the
replicas) when it is disabled. Owner references make deleting the model delete the router.

The serving Service and the model's NetworkPolicy depend on whether the router is enabled; the
model's shared objects are applied only when its pods are created or its plan changes, so they
are applied here too when their content changes. Each object is applied again only when its
content changed or every REAPPLY_SECONDS (one deleted by hand comes back): a steady pass costs no
request. A router left from an earlier spec is looked for once per model per process (one read)."""
from __future__ import annotations

import json
import logging
import threading
import time

from kubernetes.client.rest import ApiException

from shardwise.crds import names
from shardwise.operator.controller.apply import Applier, ObjectConflict
from shardwise.operator.decide.state import ModelState
from shardwise.operator.render import renderer, router, settings

log = logging.getLogger("shardwise.operator")
REAPPLY_SECONDS = 300.0


class Routers:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # model -> object (kind, name) -> (when applied, what); {} once a model is known to run no router
        self.applied: dict[tuple[str, str], dict[tuple[str, str], tuple[float, str]]] = {}

    def ensure(self, applier: Applier, state: ModelState) -> None:
        """Apply what changed of the model's router (a no-op most passes)."""
        if state.model is None or state.workload.gang:
            return
        model, key = state.model, (state.namespace, state.name)
        pods = [p for group in state.pods.values() for p in group]
        objs = router.render(model, pods)
        with self.lock:
            last = self.applied.get(key)
        try:
            if not objs:
                self._disabled(applier, state, last)
                return
            front = [renderer.render_serving_service(model)]
            if settings.current().network_policy:
                front.append(renderer.render_network_policy(model))
            # the router first, then the Service that sends traffic to it
            changed = self._apply_changed(applier, key, objs + front, last or {})
            if ("ConfigMap", names.router_name(state.name)) in changed:
                self._refresh(applier, state.namespace, state.name, router.replicas_digest(objs))
        except (ObjectConflict, ApiException) as e:
            # the model's replicas serve on whatever the router's state: said, and tried next pass
            reason = str(e) if isinstance(e, ObjectConflict) else f"{e.status} {e.reason}"
            log.warning(f"router of {state.namespace}/{state.name}: {reason}")

    def _apply_changed(self, applier: Applier, key: tuple[str, str], objs: list[dict],
                       last: dict[tuple[str, str], tuple[float, str]]) -> set[tuple[str, str]]:
        """Apply each object whose content changed (or was last applied REAPPLY_SECONDS ago); the
        objects whose content changed."""
        now, done, changed = time.monotonic(), dict(last), set()
        for obj in objs:
            ident, what = (obj["kind"], obj["metadata"]["name"]), json.dumps(obj, sort_keys=True)
            before = last.get(ident)
            if before is None or before[1] != what or now - before[0] >= REAPPLY_SECONDS:
                applier.apply(obj)
                done[ident] = (now, what)
                if before is None or before[1] != what:
                    changed.add(ident)
        with self.lock:
            self.applied[key] = done
        return changed

    @staticmethod
    def _refresh(applier: Applier, namespace: str, name: str, digest: str) -> None:
        """Annotate each running router pod with the replicas file's digest: a pod update makes its
        kubelet mount the ConfigMap's new content at once, where its periodic sync would take up to
        a minute, and a replica that has just become Ready (the first, after a scale from zero) is
        used as soon as the router re-reads its file."""
        for pod in applier.list_router_pods(namespace, name):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") or (meta.get("annotations") or {}).get(
                    names.ANNOTATION_ROUTER_REPLICAS) == digest:
                continue
            applier.annotate_pod(namespace, meta["name"], names.ANNOTATION_ROUTER_REPLICAS, digest)

    def _disabled(self, applier: Applier, state: ModelState, last) -> None:
        """No router wanted: remove one this process made, or one found left from before it ran."""
        model = state.model
        assert model is not None
        key, uid, name = (state.namespace, state.name), model.metadata["uid"], names.router_name(state.name)
        if last == {}:
            return
        if last is None and not applier.exists_owned("Deployment", state.namespace, name, uid):
            with self.lock:
                self.applied[key] = {}
            return
        applier.apply(renderer.render_serving_service(model))      # back to the replicas first
        if settings.current().network_policy:
            applier.apply(renderer.render_network_policy(model))
        for kind in reversed(router.ROUTER_KINDS):
            applier.delete_owned(kind, state.namespace, name, uid)
        log.info(f"router of {state.namespace}/{state.name} removed (spec.serving.router not enabled)")
        with self.lock:
            self.applied[key] = {}

    def forget(self, namespace: str, name: str) -> None:
        with self.lock:
            self.applied.pop((namespace, name), None)


ROUTERS = Routers()
