"""The model-shape probe: a short-lived pod that reads the model where it lives.

The planner needs the model's shape (layers, heads, sizes, parameters). The operator never opens a
path a tenant names on its own file system (only inside the model root the chart configures:
controller/modelroot.py), so every model without full hints (parameters, layers and heads) is read
by a pod instead: a pvc:// model on its claim, mounted read-only; any other path where the pods
would find it. The pod runs `shardwise inspect` (torch-free) in the operator's own worker image,
never spec.image: what reports the shape is code the operator chose. It writes the shape as JSON
to its termination message, the operator reads it from the pod's status, checks it against
MODEL_FACT_LIMITS, caches it in status.modelFacts (keyed by uri, so it runs once per uri), and
deletes the pod. A model that cannot be read fails the spec with the probe's one-line reason; one
whose store could not be reached (the probe's exit status EXIT_UNREACHABLE, or a pod that ran out of
its deadline or was evicted) is read again later (Unread.transient; decisions.py backs off).

A remote model (hf://, s3://, oci://) is probed the same way, `shardwise inspect <uri>` reading its
config.json or GGUF header from the store with the model's credentials in its environment: the
operator itself never opens a url a tenant names (from where it runs it could reach what the tenant
cannot: the API server, a cloud's metadata service).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Mapping

from shardwise.crds import boundedjson, names
from shardwise.crds.models import MODEL_FACT_LIMITS, ModelFactsStatus, ShardedModel
from shardwise.crds.modelshape import ModelFacts, ModelFactsError
from shardwise.operator.decide import recovery
from shardwise.operator.render import renderer, source
from shardwise.operator.render.settings import Settings, current

ROLE = "model-probe"
DEADLINE_SECONDS = 300      # a probe that hangs (a stuck volume) fails instead of waiting forever
FACTS_DEPTH = 4         # the probe reports one flat object of numbers
# The pod's own reasons for a failure that says nothing of the model: it ran out of its deadline (a
# slow store, a stuck mount), or the node took it back.
TRANSIENT_POD_REASONS = frozenset({"DeadlineExceeded", "Evicted", "NodeLost", "Shutdown", "Terminated"})
# After a transient failure the model is read again after this, doubled per failure in a row up to
# recovery's cap (5 s, 10 s, ... 5 min), for as long as the store stays away: the group waits Pending
# with the reason, as a pod waits for an image it cannot pull yet.
RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class Unread:
    """Why the probe could not read the model. `transient`: the store could not be reached or was
    busy, or the pod was stopped from outside; the model may be read later. Otherwise the answer is
    final for this spec (refused, not found, not a model, over the limits)."""
    reason: str
    transient: bool = False


def is_probe(pod: Mapping[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == ROLE


def pod_name(model: str, uri: str) -> str:
    """One name per model and uri: a changed uri is probed by a new pod."""
    return names.probe_pod_name(model, hashlib.sha256(uri.encode()).hexdigest()[:8])


def render(model: ShardedModel, default_image: str, settings: Settings | None = None) -> dict:
    spec = model.spec
    path, volume, mount = renderer.model_volume(spec.model.uri)
    container = {
        "name": "probe", "image": default_image,
        "command": ["shardwise", "inspect", path, "--json", "--output", renderer.TERMINATION_LOG,
                    *source.store_options(model, settings or current())],
        "volumeMounts": [mount] if mount else [],
        "terminationMessagePath": renderer.TERMINATION_LOG,
        # a failed read leaves its one-line error (the log's tail) as the message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # a remote model's probe reads config.json or the GGUF header from the store itself, with the
        # model's credentials (render/source.py): the operator never fetches a url a tenant names
        # from its own network position
        "env": source.credentials_env(model),
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": renderer.WORKER_CONTAINER_SECURITY,
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never", "containers": [container], "volumes": [volume] if volume else [],
        "activeDeadlineSeconds": DEADLINE_SECONDS, "enableServiceLinks": False,
        "securityContext": renderer.WORKER_POD_SECURITY, "terminationGracePeriodSeconds": 1,
    }
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in spec.placement.tolerations]
    labels = {**renderer.model_labels(model.name), names.LABEL_ROLE: ROLE}
    meta = {"name": pod_name(model.name, spec.model.uri), "namespace": model.namespace, "labels": labels,
            "ownerReferences": [renderer.owner_reference(model)]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def result(pod: Mapping[str, Any]) -> ModelFacts | Unread | None:
    """The shape the probe read, why it could not, or None while it runs."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase not in ("Succeeded", "Failed"):
        return None
    message = recovery.termination_message(pod).strip()
    if phase == "Failed":
        last = next((line for line in reversed(message.splitlines()) if line.strip()), "")
        why = last or status.get("message") or status.get("reason") or "the probe pod failed"
        transient = (_exit_code(pod) == names.EXIT_UNREACHABLE
                     or status.get("reason") in TRANSIENT_POD_REASONS)
        return Unread(f"cannot read the model: {why.strip()}", transient)
    try:
        facts = ModelFacts.from_dict(boundedjson.loads(message, FACTS_DEPTH))
    except (ValueError, TypeError, ModelFactsError) as e:
        return Unread(f"cannot read the model: the probe reported {message[:200]!r} ({e})")
    problem = out_of_bounds(facts)
    return Unread(f"cannot read the model: {problem}") if problem else facts


def _exit_code(pod: Mapping[str, Any]) -> int | None:
    """The probe container's exit status, None when it has not terminated (or says nothing)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        code = ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")
        return code if isinstance(code, int) else None
    return None


def out_of_bounds(facts: ModelFacts) -> str:
    """Why the operator will not plan for these facts ("" when it will): a size over MODEL_FACT_LIMITS."""
    for name, limit in MODEL_FACT_LIMITS.items():
        value = getattr(facts, name)
        if value > limit:
            return f"the model's {name} ({value}) exceeds {limit}, the most the operator plans for"
    outside = facts.embedding_params + facts.head_params
    if facts.params < outside + facts.layers:   # the layer split would spin on layers of ~1 parameter
        return (f"the model's {facts.params} parameters are fewer than its embedding and LM head "
                f"({outside}) and {facts.layers} layers hold")
    return ""


def retry_delay(failures: int) -> float:
    """Seconds before reading the model again after `failures` transient failures in a row: the
    group restarts' doubling and cap (recovery.Policy.backoff), from RETRY_SECONDS."""
    return recovery.Policy(backoff_seconds=RETRY_SECONDS).backoff(failures)


def unreached(uri: str, reason: str, before: ModelFactsStatus | None, generation: int,
              now: datetime) -> ModelFactsStatus:
    """The record of a transient failure: the count in a row (for this uri and spec) and when to retry."""
    same = before is not None and before.unreachable and before.uri == uri and before.generation == generation
    failures = (before.failures or 0) + 1 if same else 1
    at = now + timedelta(seconds=retry_delay(failures))
    return ModelFactsStatus(uri=uri, unreachable=reason, failures=failures, generation=generation,
                            retry_at=recovery.iso(at))


def retry_pending(cached: ModelFactsStatus | None, generation: int, now: datetime) -> bool:
    """A transient failure of this spec whose backoff still runs: no probe until then."""
    if cached is None or not cached.unreachable or cached.generation != generation:
        return False
    at = recovery.parse_iso(cached.retry_at)
    return at is not None and now < at


def waiting_message(pod: Mapping[str, Any] | None, model: str, uri: str,
                    cached: ModelFactsStatus | None = None) -> str:
    """What a group waiting for the model's shape says: the scheduler's words when it cannot place the
    probe (a claim that does not exist, no node matching the selector), and the last transient failure."""
    why = recovery.unschedulable_message(pod) if pod is not None else ""
    if cached is not None and cached.unreachable and cached.uri == uri:
        # first what happens next: a group's record keeps only the first 128 characters
        tries = f"{cached.failures or 1} in a row"
        if pod is None:
            return f"reading the model again at {cached.retry_at} ({tries}): {cached.unreachable}"
        why = f"{why}; " if why else ""
        return (f"reading the model's shape from {uri} again (pod {pod_name(model, uri)}): {why}"
                f"last time ({tries}): {cached.unreachable}")
    return f"reading the model's shape from {uri} (pod {pod_name(model, uri)})" + (f": {why}" if why else "")
