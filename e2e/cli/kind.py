"""`shardwise kind`: real containers on a kind cluster, every image built here from package registries.

    shardwise kind docker [--start]   check Docker; where the host cannot grant every capability,
                                      install the runtime wrapper privileged kind nodes need
    shardwise kind build [--base IMAGE] [--tag TAG] [--force]
                                      Kubernetes and kind binaries (Go modules), the kind node image,
                                      the operator and worker images (cached; the first run takes a while)
    shardwise kind up [--name N] [--reuse] [--tag TAG]
                                      create the 5-node cluster, advertise fake GPUs, push the
                                      images to the local registry the nodes pull from
    shardwise kind env [--name N]     KUBECONFIG and PATH (kubectl, helm, kind) for this shell
    shardwise kind down [--name N]    delete the cluster
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

DEFAULT_TAG = "dev"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    d = sub.add_parser("docker", help="check Docker and make privileged kind nodes work on this host")
    d.add_argument("--start", action="store_true",
                   help="start dockerd (or restart it after a change) where no service manager runs it")
    b = sub.add_parser("build", help="build the binaries, the kind node image and the two images")
    b.add_argument("--base", default=None,
                   help="base image for the operator and worker images (default: python:3.11-slim "
                        "when it is here, else shardwise/python:3.11 built from the Debian mirror)")
    b.add_argument("--tag", default=DEFAULT_TAG, help=f"tag of the two images (default {DEFAULT_TAG})")
    b.add_argument("--force", action="store_true",
                   help="rebuild the node image too (the two images are always rebuilt, from Docker's cache)")
    up = sub.add_parser("up", help="create the kind cluster and push the images to its registry")
    up.add_argument("--reuse", action="store_true", help="use the cluster if it already exists")
    up.add_argument("--tag", default=DEFAULT_TAG, help=f"tag of the images to push (default {DEFAULT_TAG})")
    for name, help_ in (("up", None), ("env", "print shell exports for this cluster"),
                        ("down", "delete the cluster")):
        p = up if name == "up" else sub.add_parser(name, help=help_)
        p.add_argument("--name", default=os.environ.get("SHARDWISE_KIND_CLUSTER", "shardwise"),
                       help="kind cluster name (default: $SHARDWISE_KIND_CLUSTER, else shardwise)")


def _err(message: str) -> int:
    print(f"shardwise kind: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    from shardwise.e2e import build
    from shardwise.e2e.kind.docker import DockerError

    try:
        return _ACTIONS[args.action](args)
    except (DockerError, build.BuildError) as e:
        return _err(str(e))


def _docker(args) -> int:
    from shardwise.e2e import build
    from shardwise.e2e.kind import docker

    lacking = docker.capabilities_missing()
    changed = False
    if lacking:
        wrapper = docker.install_runtime_wrapper()
        changed = docker.configure_daemon(wrapper)
        print(f"this host cannot grant {', '.join(lacking)}, which `docker run --privileged` asks for: "
              f"dockerd's default runtime {'is now' if changed else 'is'} {wrapper} "
              f"({docker.DAEMON_JSON}), which drops them")
    running = docker.docker("info", check=False, timeout=30).returncode == 0
    if args.start and running and changed:
        docker.stop_daemon()
        running = False
    if args.start and not running:
        log = build.cache_root() / "dockerd.log"
        docker.start_daemon(log)
        print(f"dockerd started (log: {log})")
    elif changed and running:
        return _err("restart dockerd so that it reads the new runtime (`systemctl restart docker`, "
                    "or `shardwise kind docker --start` where there is no systemd)")
    info = docker.check_daemon()
    if lacking and info.get("DefaultRuntime") != docker.RUNTIME_NAME:
        return _err(f"dockerd's default runtime is {info.get('DefaultRuntime')}, not "
                    f"{docker.RUNTIME_NAME}: restart dockerd")
    print(f"Docker {info.get('ServerVersion')} ({info.get('Driver')}, cgroup v{info.get('CgroupVersion')}"
          f", runtime {info.get('DefaultRuntime')}): ready for kind")
    return 0


def _build(args) -> int:
    from shardwise.e2e import build
    from shardwise.e2e.kind import images
    from shardwise.e2e.kind import nodeimage, space
    from shardwise.e2e.kind.docker import check_daemon, image_size

    def say(line: str) -> None:
        print(line, flush=True)

    check_daemon()
    build.build(say=say, wanted=(*build.ALL_BINARIES, *build.KIND_BINARIES))
    nodeimage.build_node_image(say=say, force=args.force)
    names = images.build_product(args.tag, base=args.base, say=say)
    space.prune_superseded(say)
    for ref in (nodeimage.NODE_IMAGE, names.operator, names.worker):
        print(f"  {ref:<40} {image_size(ref) / 1e9:6.2f} GB")
    return 0


def _up(args) -> int:
    from shardwise.e2e.kind import images
    from shardwise.e2e.kind.cluster import KindCluster

    cluster = KindCluster(args.name)
    names = images.product_images(args.tag)
    if args.reuse and cluster.exists():
        cluster.advertise_gpus()   # a node container that restarted lost its fake GPUs
    else:
        cluster.create(room_for=(names.operator, names.worker))
    pushed = cluster.push_product(names)
    print(f"images for the chart: image.repository={pushed.operator.rsplit(':', 1)[0]} "
          f"image.tag={pushed.operator.rsplit(':', 1)[1]} operator.workerImage={pushed.worker}")
    print(f'export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}')
    return 0


def _env(args) -> int:
    from shardwise.e2e.kind.cluster import KindCluster

    cluster = KindCluster(args.name)
    print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    print(f"export PATH={shlex.quote(str(cluster.bin_dir))}:\"$PATH\"")
    return 0


def _down(args) -> int:
    from shardwise.e2e.kind.cluster import KindCluster

    KindCluster(args.name).delete()
    return 0


_ACTIONS = {"docker": _docker, "build": _build, "up": _up, "env": _env, "down": _down}
