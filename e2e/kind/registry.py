"""A local image registry for the kind nodes, built from the distribution Go module.

`kind load` copies a whole image into every node as uncompressed blobs plus an unpacked snapshot:
the 3.8 GB worker image costs ~7.6 GB per node and is copied again whole after any change. Through a
registry, as on a real cluster, only the nodes that run a pod pull it, layers travel compressed, an
unchanged layer is not pushed again, and the nodes' containerd discards the compressed blobs once
unpacked (kind's `discard_unpacked_layers`).

The registry runs as a Docker container on kind's network, published on 127.0.0.1:5001; images are
named `localhost:5001/...` on both sides: Docker pushes to loopback (an insecure registry Docker
allows by default) and each node's containerd maps that name to the container (`containerd_patch`).
Its storage is a Docker volume, kept across clusters.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from shardwise.e2e import build
from shardwise.e2e.kind.docker import DockerError, docker, image_exists
from shardwise.e2e.kind.images import docker_build, run_logged

NAME = "shardwise-registry"
HOST_PORT = 5001
PREFIX = f"localhost:{HOST_PORT}"
IMAGE = f"shardwise/registry:{build.REGISTRY}"
KIND_NETWORK = "kind"

_CONFIG = """\
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: /var/lib/registry}
  delete: {enabled: true}
http: {addr: ":5000"}
"""


def containerd_patch() -> str:
    """What each node's containerd needs to pull `localhost:5001/...` from the registry container."""
    return (f'[plugins."io.containerd.grpc.v1.cri".registry.mirrors."{PREFIX}"]\n'
            f'  endpoint = ["http://{NAME}:5000"]\n')


def build_image(say=print) -> str:
    if image_exists(IMAGE):
        return IMAGE
    binary = build.build(say=say, wanted=("registry",)) / "registry"
    with tempfile.TemporaryDirectory(prefix="shardwise-registry-") as ctx:
        shutil.copy2(binary, Path(ctx) / "registry")
        (Path(ctx) / "config.yml").write_text(_CONFIG)
        (Path(ctx) / "Dockerfile").write_text(
            "FROM scratch\nCOPY registry /registry\nCOPY config.yml /etc/distribution/config.yml\n"
            'VOLUME /var/lib/registry\nEXPOSE 5000\nENTRYPOINT ["/registry"]\n'
            'CMD ["serve", "/etc/distribution/config.yml"]\n')
        docker_build(Path(ctx) / "Dockerfile", IMAGE, Path(ctx), say)
    return IMAGE


def ensure_running(say=print) -> None:
    """Start the registry container (or restart a stopped one) and attach it to kind's network."""
    state = docker("inspect", "--format", "{{.State.Running}}", NAME, check=False)
    if state.returncode != 0:
        build_image(say)
        docker("run", "-d", "--restart=always", "--name", NAME, "-p", f"127.0.0.1:{HOST_PORT}:5000",
               "-v", f"{NAME}:/var/lib/registry", IMAGE)
    elif state.stdout.decode().strip() != "true":
        docker("start", NAME)
    networks = docker("inspect", "--format", "{{json .NetworkSettings.Networks}}", NAME).stdout.decode()
    if f'"{KIND_NETWORK}"' not in networks and docker("network", "inspect", KIND_NETWORK,
                                                       check=False).returncode == 0:
        docker("network", "connect", KIND_NETWORK, NAME)
    deadline = time.monotonic() + 30
    while docker("exec", NAME, "/registry", "--version", check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise DockerError(f"the registry container {NAME} did not start; see `docker logs {NAME}`")
        time.sleep(1)


def collect_garbage(say=print) -> None:
    """Delete the layers no tag reaches any more (an image pushed again under the same tag leaves the
    old one's behind). Run right after this process's own pushes: the collector must not race an
    upload, and nothing else pushes to this registry."""
    from shardwise.e2e.kind import space

    if docker("inspect", "--format", "{{.State.Running}}", NAME, check=False).stdout.decode().strip() != "true":
        return
    space.reclaim("the registry's untagged layers", lambda: run_logged(
        ["docker", "exec", NAME, "/registry", "garbage-collect", "--delete-untagged",
         "/etc/distribution/config.yml"], "registry garbage-collect", lambda line: None), say)


def push(image: str, say=print) -> str:
    """Tag `image` as localhost:5001/<image> and push it; returns the name the nodes pull."""
    ensure_running(say)
    remote = f"{PREFIX}/{image}"
    docker("tag", image, remote)
    run_logged(["docker", "push", remote], f"docker push {remote}", say)
    return remote
