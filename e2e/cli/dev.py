"""`shardwise dev`: build, start, inspect and stop the local Kubernetes control plane.

    shardwise dev build                    build the pinned binaries (cached; minutes the first time)
    shardwise dev up [--nodes N] [--gpus-per-node G] [--racks R] [--zones Z] [--local-nodes K]
    eval "$(shardwise dev env)"            KUBECONFIG and PATH (kubectl, helm) for this shell
    shardwise dev status                   components, their pids and logs, nodes
    shardwise dev node-down NAME           stop a node's heartbeat (and a local node's processes)
    shardwise dev node-up NAME             bring it back
    shardwise dev down                     stop everything and remove the state folder
"""
from __future__ import annotations

import argparse
import shlex
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", help="state folder (default: $SHARDWISE_DEV_DIR or "
                        "~/.local/state/shardwise/dev)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="build the pinned Kubernetes binaries into the cache")
    b.add_argument("--force", action="store_true", help="rebuild even if the cache is complete")
    sub.add_parser("build-s3", help="build the S3 server (MinIO, from its Go module) that s3:// models "
                   "and the fetch tests run against, into the cache")
    up = sub.add_parser("up", help="start the control plane and its nodes")
    up.add_argument("--nodes", type=_count, default=4, help="simulated GPU nodes (default 4)")
    up.add_argument("--gpus-per-node", type=_positive, default=8, help="GPUs per node (default 8)")
    up.add_argument("--racks", type=_positive, default=2, help="racks the nodes fill (default 2)")
    up.add_argument("--zones", type=_positive, default=1,
                    help="zones the racks are spread over (default 1)")
    up.add_argument("--local-nodes", type=_count, default=0,
                    help="nodes whose pods run as local processes (default 0)")
    up.add_argument("--local-gpus-per-node", type=_count, default=None,
                    help="GPUs a local node advertises (default: --gpus-per-node)")
    up.add_argument("--gpu-product", default=None, help="nvidia.com/gpu.product label value")
    up.add_argument("--gpu-memory-mib", type=_positive, default=None,
                    help="nvidia.com/gpu.memory label value in MiB")
    up.add_argument("--port", type=_count, default=0,
                    help="kube-apiserver port on 127.0.0.1 (default: a free one)")
    sub.add_parser("down", help="stop everything and remove the state folder")
    sub.add_parser("env", help="print shell exports for KUBECONFIG and PATH")
    sub.add_parser("status", help="show components and nodes")
    for name, help_ in (("node-down", "stop a node's heartbeat (kills a local node's pods)"),
                        ("node-up", "resume a node's heartbeat")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("node")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _err(message: str) -> int:
    print(f"shardwise dev: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    from shardwise.e2e import build
    from shardwise.e2e.localcluster import controlplane as cp

    if args.action == "build":
        try:
            path = build.build(force=args.force, say=lambda s: print(s, flush=True))
        except build.BuildError as e:
            return _err(str(e))
        print(f"binaries ready in {path}")
        return 0
    if args.action == "build-s3":
        from shardwise.e2e import s3server
        try:
            path = s3server.build_s3_server(say=lambda s: print(s, flush=True))
        except build.BuildError as e:
            return _err(str(e))
        print(f"S3 server ready: {path}")
        return 0

    plane = cp.ControlPlane(args.state_dir)
    try:
        if args.action == "up":
            return _up(plane, args, cp)
        if args.action == "down":
            if plane.down(say=lambda s: print(s, flush=True)):
                print("local cluster stopped; state removed")
            else:
                print("no local cluster was running")
            return 0
        if args.action == "env":
            if not plane.is_running():
                return _err("no local cluster is running; start one with `shardwise dev up`")
            state = plane.state()
            print(f"export KUBECONFIG={shlex.quote(str(plane.kubeconfig))}")
            print(f"export PATH={shlex.quote(state.bin_dir)}:\"$PATH\"")
            return 0
        if args.action == "status":
            return _status(plane, cp)
        if args.action in ("node-down", "node-up"):
            return _node_down(plane, cp, args.node, args.action == "node-down")
    except cp.ControlPlaneError as e:
        return _err(str(e))
    except (OSError, ValueError) as e:  # e.g. an API server that went away mid-command
        return _err(f"{type(e).__name__}: {e}")
    return 2


def _up(plane, args, cp) -> int:
    spec = cp.ClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, racks=args.racks,
                          zones=args.zones, local_nodes=args.local_nodes,
                          local_gpus_per_node=args.local_gpus_per_node, apiserver_port=args.port)
    if args.gpu_product:
        spec.gpu_product = args.gpu_product
    if args.gpu_memory_mib:
        spec.gpu_memory_mib = args.gpu_memory_mib
    plane.up(spec, say=lambda s: print(s, flush=True))
    print("\nuse it with:  eval \"$(shardwise dev env)\"  then  kubectl get nodes")
    return 0


def _status(plane, cp) -> int:
    status = plane.component_status()
    if not status:
        print("no local cluster (state folder: %s)" % plane.dir)
        return 1
    state = plane.state()
    print(f"API server  {state.server}")
    print(f"kubeconfig  {plane.kubeconfig}")
    for component, alive in status:
        print(f"{component.name:<24} {'running' if alive else 'STOPPED':<8} pid {component.pid:<7} "
              f"{component.log}")
    if not plane.is_running():
        return 1
    from shardwise.e2e.localcluster.nodes import LOCAL_NODE_LABEL, node_ready
    nodes = plane.client().get("/api/v1/nodes")["items"]
    ready = sum(node_ready(n) for n in nodes)
    local = sum(n["metadata"].get("labels", {}).get(LOCAL_NODE_LABEL) == "true" for n in nodes)
    print(f"nodes       {len(nodes)} ({ready} Ready, {local} local)")
    return 0 if all(alive for _, alive in status) else 1


def _node_down(plane, cp, name: str, down: bool) -> int:
    if not plane.is_running():
        return _err("no local cluster is running")
    from shardwise.e2e.localcluster import kapi
    from shardwise.e2e.localcluster.nodes import set_node_down
    try:
        set_node_down(plane.client(), name, down)
    except kapi.ApiError as e:
        if e.status == 404:
            return _err(f"node {name!r} not found")
        raise cp.ControlPlaneError(str(e))
    print(f"node {name}: heartbeat {'stopped' if down else 'resumed'}"
          + (f"; NotReady within ~{cp.NODE_MONITOR_GRACE}, pods evicted "
             f"{cp.TOLERATION_SECONDS}s later" if down else ""))
    return 0
