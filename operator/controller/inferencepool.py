"""The model's InferencePool (render/inferencepool.py), made when the cluster serves the Gateway API
Inference Extension's API and left out when it does not. Whether it does is asked of the discovery
API at most every DISCOVERY_SECONDS (a CRD installed later is seen within that), and a pool is
applied again only when it changed or every REAPPLY_SECONDS (a pool deleted by hand comes back),
so a steady pass costs no request for it."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

from kubernetes.client.rest import ApiException

from shardwise.operator.controller.apply import Applier, ObjectConflict
from shardwise.operator.decide.state import ModelState
from shardwise.operator.render import inferencepool

log = logging.getLogger("shardwise.operator")
DISCOVERY_SECONDS = 10.0
REAPPLY_SECONDS = 300.0


class Pools:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked: Optional[tuple[float, bool]] = None          # (when, served)
        self.applied: dict[tuple[str, str], tuple[float, str]] = {}  # model -> (when, what)

    def served(self, applier: Applier) -> bool:
        now = time.monotonic()
        with self.lock:
            if self.checked is not None and now - self.checked[0] < DISCOVERY_SECONDS:
                return self.checked[1]
        found = applier.serves(inferencepool.GROUP, inferencepool.VERSION, inferencepool.PLURAL)
        with self.lock:
            self.checked = (now, found)
            if not found:
                self.applied.clear()
        return found

    def ensure(self, applier: Applier, state: ModelState) -> None:
        """Apply the model's pool when a serving model has one to have (a no-op most passes)."""
        if state.model is None or state.workload.gang or not self.served(applier):
            return
        pool = inferencepool.render(state.model)
        what = json.dumps(pool, sort_keys=True)
        key = (state.namespace, state.name)
        with self.lock:
            last = self.applied.get(key)
        if last is not None and last[1] == what and time.monotonic() - last[0] < REAPPLY_SECONDS:
            return
        try:
            applier.apply(pool)
        except (ObjectConflict, ApiException) as e:
            # The pool is an extra: a pool of that name that is someone else's, or no right to make
            # one (an older chart's RBAC), must not stop the model's reconcile. Said once per
            # REAPPLY_SECONDS, then tried again.
            reason = str(e) if isinstance(e, ObjectConflict) else f"{e.status} {e.reason}"
            log.warning(f"no InferencePool for {state.namespace}/{state.name}: {reason}")
        with self.lock:
            self.applied[key] = (time.monotonic(), what)

    def forget(self, namespace: str, name: str) -> None:
        with self.lock:
            self.applied.pop((namespace, name), None)


POOLS = Pools()
