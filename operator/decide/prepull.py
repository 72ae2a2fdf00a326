"""Pre-pull (spec.model.prePull), pure: a replica group's pods wait until the caches of its planned
nodes hold what they will load, fetched by one short-lived pod per node (render/prepull.py).

After a pass has decided to create a group's pods (a new group, or a group re-planned after a
failure: a CreatePods action, while no pod of that attempt exists), `gate` holds the creation back:
  - no pre-pull pod of that attempt yet: its pods are created, one per node of the group's plan,
    all at once (a PrePulling Event);
  - some still running: the group waits (its GPUs stay reserved in the operator's count meanwhile,
    so that another model is not planned onto them: reconciler._reserve);
  - every one finished: the group's pods are created, then the pre-pull pods deleted. One that
    failed, ran past its deadline or sits on a node that is no longer Ready blocks nothing: the
    group's pods are created anyway and fetch what is missing themselves (a PrePullFailed Warning
    says so). A pre-pull never blocks serving.
A training job's replicas are one world: they are released together.

The pre-pull pods are deleted only after the pods of their group were created (in the actions'
order), so a pass interrupted in between finds either the pre-pull pods done (and creates the group
again) or the group's pods (and deletes the leftovers). Pre-pull pods nothing waits for any more (a
group torn down, scaled away, re-planned at a new attempt, prePull turned off) are deleted.
"""
from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from shardwise.crds import names
from shardwise.crds.status import ConditionType, PrePullReason
from shardwise.operator.decide import nodecache, recovery
from shardwise.operator.decide.actions import Action, CreatePods, CreatePrePull, DeletePods, Event
from shardwise.operator.decide.conditions import condition, set_condition
from shardwise.operator.decide.state import ModelState
from shardwise.operator.render import prepull as render

# A pre-pull pod not finished this long after its creation is given up on (activeDeadlineSeconds
# counts from its start; a pod whose kubelet never starts it has none).
GIVE_UP_SECONDS = render.DEADLINE_SECONDS + 120
REQUEUE_SECONDS = 2.0
MESSAGE_NODES = 4         # nodes a message names; the rest are counted


def wanted(state: ModelState) -> bool:
    """The model asks for pre-pulls and its pods cache on their nodes."""
    return state.model is not None and bool(state.spec.model.pre_pull) and nodecache.caches_on_nodes(state)


def succeeded_nodes(state: ModelState) -> list[str]:
    """Nodes where a pre-pull pod of the current spec finished: their caches hold its share."""
    return sorted({(p.get("spec") or {}).get("nodeName") for p in state.prepull_pods
                   if (p.get("status") or {}).get("phase") == "Succeeded" and (p.get("spec") or {}).get("nodeName")
                   and (p["metadata"].get("labels") or {}).get(names.LABEL_SPEC_HASH) == state.spec_hash})


def outcome(pod: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]], now: datetime) -> str | None:
    """None while the pod runs; "" once it succeeded; else why it failed, one line."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase == "Succeeded":
        return ""
    if phase == "Failed":
        last = next((line.strip() for line in reversed(recovery.termination_message(pod).splitlines())
                     if line.strip()), "")
        return (last or status.get("message") or status.get("reason") or "failed")[:200]
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if not recovery.node_ready(nodes.get(node)):
        return "its node is not Ready"
    created = recovery.parse_iso(pod["metadata"].get("creationTimestamp"))
    if created is not None and (now - created).total_seconds() > GIVE_UP_SECONDS:
        return f"not done after {GIVE_UP_SECONDS} s"
    return None


@dataclasses.dataclass
class Gate:
    """What `gate` makes of a pass's actions."""
    actions: list[Action]
    events: list[Event]
    held: tuple[CreatePods, ...] = ()     # groups whose pods wait for their pre-pull
    note: str = ""                        # for status: the groups waiting, and how far they are


@dataclasses.dataclass
class _Group:
    create: CreatePods
    pods: dict[str, Mapping[str, Any] | None]    # node -> its pre-pull pod (None: not made yet)
    results: dict[str, str | None]               # node -> outcome of its pod

    @property
    def finished(self) -> bool:
        return all(p is not None for p in self.pods.values()) and all(r is not None for r in self.results.values())


def gate(state: ModelState, nodes: Mapping[str, Mapping[str, Any]], actions: Sequence[Action],
         now: datetime) -> Gate:
    """The pass's actions with the creation of pre-pulling groups held back (see the module)."""
    if not wanted(state):
        return Gate(list(actions), [], (), "") if not state.prepull_pods else \
            Gate([*actions, *_sweep(state, set())], [], (), "")
    by_name = {p["metadata"]["name"]: p for p in state.prepull_pods}
    groups = {id(a): _group(state, a, by_name, nodes, now) for a in actions
              if isinstance(a, CreatePods) and not _has_pods(state, a.replica, a.attempt)}
    hold_all = state.workload.gang and any(not g.finished for g in groups.values())
    out: list[Action] = []
    events: list[Event] = []
    held: list[CreatePods] = []
    notes: list[str] = []
    keep: set[str] = set()
    for action in actions:
        group = groups.get(id(action))
        if group is None:
            out.append(action)
        elif group.finished and not hold_all:
            out.append(action)
            events.append(_released(state, group))
        else:
            held.append(group.create)
            notes.append(_progress(group))
            keep |= {render.pod_name(state.name, group.create.replica, group.create.attempt, n) for n in group.pods}
            missing = tuple(n for n, p in group.pods.items() if p is None)
            if missing:
                out.append(CreatePrePull(group.create.replica, group.create.attempt, group.create.plan, missing,
                                         group.create))
            if len(missing) == len(group.pods):
                events.append(Event("Normal", "PrePulling", f"replica {group.create.replica}: fetching "
                                    f"{state.spec.model.uri} into the caches of {_nodes(list(group.pods))} "
                                    f"before its pods start"))
    return Gate(out + _sweep(state, keep), events, tuple(held), "; ".join(notes))


def _group(state: ModelState, create: CreatePods, by_name: Mapping[str, Mapping[str, Any]],
           nodes: Mapping[str, Mapping[str, Any]], now: datetime) -> _Group:
    pods = {n: by_name.get(render.pod_name(state.name, create.replica, create.attempt, n))
            for n in render.plan_nodes(create.plan, create.replica)}
    return _Group(create, pods, {n: outcome(p, nodes, now) for n, p in pods.items() if p is not None})


def _has_pods(state: ModelState, replica: int, attempt: int) -> bool:
    return any((p["metadata"].get("labels") or {}).get(names.LABEL_ATTEMPT) == str(attempt)
               for p in state.pods.get(replica, []))


def _sweep(state: ModelState, keep: set[str]) -> list[Action]:
    """Deleting the pre-pull pods nothing waits for (after the pass's other actions)."""
    gone = tuple(sorted(p["metadata"]["name"] for p in state.prepull_pods
                        if p["metadata"]["name"] not in keep and not p["metadata"].get("deletionTimestamp")))
    return [DeletePods(gone)] if gone else []


def _released(state: ModelState, group: _Group) -> Event:
    r, uri = group.create.replica, state.spec.model.uri
    failed = [f"{n}: {why}" for n, why in group.results.items() if why]
    if failed:
        return Event("Warning", "PrePullFailed", f"replica {r}: the pre-pull of {uri} failed on {len(failed)} of "
                     f"{len(group.pods)} node(s) ({_first(failed)}); creating its pods anyway: they fetch what "
                     f"is missing themselves")
    return Event("Normal", "PrePulled", f"replica {r}: {uri} is in the caches of {_nodes(list(group.pods))}; "
                                        f"creating its pods")


def _progress(group: _Group) -> str:
    done = sum(1 for r in group.results.values() if r is not None)
    return f"replica {group.create.replica}: pre-pulling on {done} of {len(group.pods)} node(s) done"


def _nodes(found: list[str]) -> str:
    more = f" and {len(found) - MESSAGE_NODES} more" if len(found) > MESSAGE_NODES else ""
    return f"{len(found)} node(s) ({', '.join(found[:MESSAGE_NODES])}{more})"


def _first(items: Iterable[str]) -> str:
    items = list(items)
    more = f"; {len(items) - MESSAGE_NODES} more" if len(items) > MESSAGE_NODES else ""
    return "; ".join(items[:MESSAGE_NODES]) + more


def report(status: dict, note: str, stamp: str) -> None:
    """The PrePulling condition and the phase message of `status` (the pass's, built by status.py)."""
    conditions = status.get("conditions") or []
    if note:
        status["message"] = f"{status['message']}; {note}"
        status["conditions"] = set_condition(conditions, ConditionType.PRE_PULLING.value, True,
                                             PrePullReason.FETCHING.value, note, stamp)
    elif (condition(conditions, ConditionType.PRE_PULLING.value) or {}).get("status") == "True":
        status["conditions"] = set_condition(conditions, ConditionType.PRE_PULLING.value, False,
                                             PrePullReason.DONE.value, "no replica waits for a pre-pull", stamp)
