"""Docker's disk for the kind cluster: what a cluster needs, and what earlier builds left behind.

Every GPU node that runs a worker pod unpacks the worker image (3.8 GB: torch's CUDA wheels, which a
CPU pod still imports) into its own containerd, so a cluster needs room for the image once per node,
and a node stop moves pods onto nodes that have not pulled it yet. Without that room the pull fails
with "no space left on device" deep inside a node, minutes into a test; `check_room` says so in one
line before the cluster is made.

What each `shardwise kind build` leaves behind is removed by the next (`prune_superseded`): it tags
every stage of the operator and worker images (`stage_tag`) and labels each image it makes (LABEL),
so an untagged image with that label is one a later build superseded. The
local registry keeps the layers of every image pushed under a tag that has since moved until its
garbage collector runs (registry.collect_garbage, after each push). Images this project did not
make are never touched.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from shardwise.e2e.kind.docker import DockerError, docker

# On every image `shardwise kind build` makes; an untagged one carrying it was superseded.
LABEL = "dev.shardwise.build"
GB = 1e9
# Beyond the images: the node image's containers, logs, pod volumes, the registry's own writes.
MARGIN_BYTES = 3 * GB


def stage_tag(image: str, stage: str) -> str:
    """The tag that keeps an intermediate stage of `image` (a build cache) from being superseded."""
    repository, _, tag = image.rpartition(":")
    return f"{repository}-{stage}:{tag}"


def stages(dockerfile: Path) -> list[str]:
    """The named stages of a Dockerfile (`FROM … AS name`), in order."""
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", dockerfile.read_text(), re.M | re.I)


def root_dir() -> Path | None:
    """Docker's data root when the daemon is on this machine (None for a remote DOCKER_HOST)."""
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return None
    out = docker("info", "--format", "{{.DockerRootDir}}", check=False, timeout=30)
    path = Path(out.stdout.decode().strip() or "/")
    return path if out.returncode == 0 and path.is_dir() else None


def free_bytes() -> int | None:
    root = root_dir()
    return shutil.disk_usage(root).free if root is not None else None


def needed_bytes(image_sizes: list[int], nodes: int) -> int:
    """Room a cluster of `nodes` GPU nodes needs for images of `image_sizes` bytes (unpacked): each
    node may hold every one of them once pods have moved across it."""
    return nodes * sum(image_sizes) + int(MARGIN_BYTES)


def check_room(image_sizes: list[int], nodes: int, free: int | None = None) -> None:
    """Raise DockerError, in one line, when Docker's disk cannot hold what the cluster will pull."""
    free = free_bytes() if free is None else free
    if free is None:
        return   # a remote daemon: its disk is not visible from here
    need = needed_bytes(image_sizes, nodes)
    if free < need:
        raise DockerError(
            f"Docker's disk has {free / GB:.1f} GB free; a cluster of {nodes} GPU nodes needs about "
            f"{need / GB:.1f} GB (each node unpacks the worker and operator images, "
            f"{sum(image_sizes) / GB:.1f} GB): free some (`docker image prune`, `docker volume prune`) "
            f"or run fewer nodes")


def reclaim(what: str, action, say=print) -> None:
    """Run `action` (a removal) and say how much room it gave back, when that is worth a line."""
    before = free_bytes()
    action()
    after = free_bytes()
    if before is not None and after is not None and after - before >= 0.1 * GB:
        say(f"  reclaimed {(after - before) / GB:.1f} GB of {what}")


def prune_superseded(say=print) -> None:
    """Remove the images of earlier builds that a later one replaced (untagged, with LABEL)."""
    reclaim("superseded images", lambda: docker(
        "image", "prune", "--force", "--filter", f"label={LABEL}", check=False, timeout=600), say)
