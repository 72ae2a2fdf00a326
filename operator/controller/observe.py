"""observe: read one ShardedModel, its pods and its stored plan from the API server into the typed
`ModelState` (decide/state.py) that the pure `decisions.decide()` works on."""
from __future__ import annotations

from shardwise.operator.controller import modelroot
from shardwise.operator.controller.apply import Applier
from shardwise.operator.decide.state import ModelState, parse_state
from shardwise.operator.render import renderer


def observe(applier: Applier, namespace: str, name: str,
            default_image: str = renderer.DEFAULT_IMAGE) -> ModelState | None:
    """Read one model, its pods and its stored plan (three requests); None when it is gone or going."""
    body = applier.get_model(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    pods = applier.list_model_pods(namespace, name)
    configmap = applier.get_configmap(namespace, renderer.configmap_name(name))
    return parse_state(body, pods, configmap, default_image, modelroot.read)

