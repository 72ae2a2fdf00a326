"""The plan command: the ShardPlan a manifest would get, offline or from a cluster's nodes.

`shardwise plan -f model.yaml (--nodes nodes.yaml | --from-cluster) [-o table|json|yaml]`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="ShardedModel manifest (YAML)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--nodes", help="output of `kubectl get nodes -o yaml` (may include pods: "
                                        "`kubectl get nodes,pods -A -o yaml`; their GPUs count as taken)")
    source.add_argument("--from-cluster", action="store_true",
                        help="read nodes and pods from the cluster of the current kubeconfig")
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")


def _load_spec(path: str) -> Any:
    import yaml

    from shardwise.crds.models import load_manifest

    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read ({str(e).splitlines()[0]})") from None
    models = [d for d in docs if isinstance(d, dict) and d.get("kind") == "ShardedModel"]
    if not models:
        raise ValueError(f"{path}: no ShardedModel in the file")
    return load_manifest(models[0])


def _from_cluster() -> tuple[list[dict], list[dict]]:
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except Exception as e:  # noqa: BLE001 - inside a pod there is no kubeconfig file
        try:
            config.load_incluster_config()
        except Exception:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"no cluster to read: {first} (and not running in a pod)") from None
    try:
        core = client.CoreV1Api()
        nodes = core.list_node(_request_timeout=30).items
        pods = core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed", _request_timeout=30).items
    except Exception as e:  # noqa: BLE001 - one line for the user, whatever the client raised
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read nodes and pods from the cluster: {first}") from None
    return as_dicts(nodes), as_dicts(pods)


def as_dicts(objects: list[Any]) -> list[dict]:
    """Kubernetes client objects as the dicts `kubectl get -o yaml` prints: what the inventory reads."""
    from kubernetes.client import ApiClient

    return [ApiClient().sanitize_for_serialization(o) for o in objects]


def table(plan: Any) -> str:
    rows = [("REPLICA", "STAGE", "NODE", "GPUS", "LAYERS", "PARAMS", "DOMAINS")]
    for p in plan.placements:
        rows.append((str(p.replica), str(p.stage), p.node, str(p.gpus), f"{p.layer_start}-{p.layer_end - 1}",
                     f"{p.params / 1e9:.2f}B", ",".join(p.domains.values()) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    # context parallelism: the replicas are C ranks per sequence x the data-parallel replicas
    cp = f" (context parallel {plan.context}: {plan.replicas // plan.context} data-parallel)" if plan.context > 1 else ""
    head = (f"tensor {plan.tensor} × pipeline {plan.pipeline} × {plan.replicas} replica(s){cp}; "
            f"{plan.memory_per_gpu / 2**30:.1f} GiB per GPU; cost {plan.cost}"
            + (" (shrunk)" if plan.shrunk else ""))
    return "\n".join([head, *lines, "", *[g.explanation for g in plan.groups], *plan.notes])


def run(args: argparse.Namespace) -> int:
    from shardwise.crds import modelshape, names
    from shardwise.operator.planning import inventory
    from shardwise.operator.planning import planner

    try:
        manifest = _load_spec(args.filename)
        spec = manifest.spec
        facts = modelshape.resolve(spec, base=Path(args.filename).resolve().parent)
        if args.from_cluster:
            raw_nodes, raw_pods = _from_cluster()
        else:
            raw_nodes, raw_pods = inventory.load(args.nodes)
        # This model's own pods are not "taken": the plan says where they would all go afresh.
        own = {names.LABEL_MODEL: manifest.name}
        nodes = inventory.build(raw_nodes, raw_pods, spec.gpu.resource_name, ignore_pod=lambda pod: all(
            (pod.get("metadata") or {}).get("labels", {}).get(k) == v for k, v in own.items())
            and (pod.get("metadata") or {}).get("namespace", "default") == manifest.namespace)
        plan = planner.plan(spec, facts, nodes)
    except (ValueError, OSError) as e:  # PlanError and ModelFactsError are ValueErrors
        print(f"shardwise plan: {e}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    elif args.output == "yaml":
        import yaml
        print(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False), end="")
    else:
        print(table(plan))
    return 0
