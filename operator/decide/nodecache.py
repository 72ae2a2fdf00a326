"""Which nodes' node-local caches hold a remote model's files, as the operator saw them fill (pure):
status.nodeCache, which the planner reads as a preference (operator/planning/placement.py warm).

A node is added when a pod of the model's current spec is Ready on it (a pod of an hf://, s3:// or
oci:// model is Ready only once its share is in the cache) or a pre-pull pod of the model Succeeded
on it (decide/prepull.py). The list is the model's own: keyed by spec.model.uri and endpoint (a
changed uri, revision in it or store is other files: the list starts again), the nodes seen this
pass first, at most
NODE_CACHE_MAX_NODES. A model whose pods cache in their own emptyDir (spec.model.cache pod, or the
operator's cache off) leaves nothing on a node: no list.

The list is read back from status, which is not the operator's alone to write: it is only ever a
hint. The planner still takes only nodes the spec may use (Ready, matching, with free GPUs), and
warmth only orders placements equal in topology boundaries and spread; a forged list can steer a
group among the nodes it could have landed on anyway, nowhere else. Entries that are not node
names are dropped.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from pydantic import ValidationError

from shardwise.crds import names
from shardwise.crds.access import DNS_SUBDOMAIN_PATTERN
from shardwise.crds.models import ModelCache
from shardwise.crds.status import NODE_CACHE_MAX_NODES, NodeCacheStatus
from shardwise.operator.decide.recovery import pod_ready
from shardwise.operator.decide.state import ModelState
from shardwise.operator.render import settings as render_settings
from shardwise.operator.render import source

NODE_NAME_MAX = 253
_NODE_NAME = re.compile(DNS_SUBDOMAIN_PATTERN)


def stored(status: Mapping[str, Any], uri: str, endpoint: str | None = None) -> list[str]:
    """The nodes status.nodeCache holds for `uri` at `endpoint` ([] for another source, or a list that
    does not parse)."""
    try:
        found = NodeCacheStatus.model_validate(status.get("nodeCache") or {"uri": ""})
    except ValidationError:
        return []
    if (found.uri, found.endpoint) != (uri, endpoint):
        return []
    nodes = [n for n in found.nodes if isinstance(n, str) and len(n) <= NODE_NAME_MAX and _NODE_NAME.match(n)]
    return list(dict.fromkeys(nodes))[:NODE_CACHE_MAX_NODES]


def caches_on_nodes(state: ModelState) -> bool:
    """The model's pods fetch into the node-local cache (a remote model, spec.model.cache node, the
    operator's cache on)."""
    if state.model is None or not state.spec.model.remote_scheme():
        return False
    return source.cache_mode(state.model, render_settings.current()) == ModelCache.NODE


def seen_now(state: ModelState, prepulled: Iterable[str] = ()) -> list[str]:
    """Nodes where this pass sees the files: a current-spec pod Ready there, or a pre-pull done there."""
    found = []
    for pods in state.pods.values():
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            node = (pod.get("spec") or {}).get("nodeName")
            if node and labels.get(names.LABEL_SPEC_HASH) == state.spec_hash and pod_ready(pod):
                found.append(node)
    return sorted(set(found) | set(prepulled))


def update(state: ModelState, prepulled: Iterable[str] = ()) -> NodeCacheStatus | None:
    """status.nodeCache after this pass: the nodes seen now first (new ones, then those already
    listed, in their order), then the others listed before; None when nothing is cached on nodes."""
    if not caches_on_nodes(state):
        return None
    uri, endpoint = state.spec.model.uri, state.spec.model.endpoint
    before = stored(state.status, uri, endpoint)
    seen = set(seen_now(state, prepulled))
    ordered = ([n for n in sorted(seen) if n not in before] + [n for n in before if n in seen]
               + [n for n in before if n not in seen])
    return NodeCacheStatus(uri=uri, endpoint=endpoint, nodes=ordered[:NODE_CACHE_MAX_NODES])
