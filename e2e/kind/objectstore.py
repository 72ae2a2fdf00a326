"""A real S3 server inside the kind cluster: MinIO, the binary `shardwise dev build-s3` builds from its
Go module (shardwise.e2e.s3server), packed into an image here and pulled by the nodes from the local
registry, run as e2e/kind/servers.py runs a server in the cluster: a Deployment and a Service in a
namespace of its own that enforces Pod Security `restricted`, on the control-plane node, its objects
in an emptyDir. Its credentials are random, made once per deployment, and given to it through a Secret.

    image = objectstore.push_image()                       # built once, then pushed (cheap when unchanged)
    store = objectstore.deploy(cluster, image)             # waits for the server to be Ready
    store.endpoint                                         # http://minio.object-store.svc.cluster.local:9000
"""
from __future__ import annotations

import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardwise.e2e import s3server
from shardwise.e2e.kind import registry, servers
from shardwise.e2e.kind.docker import image_exists
from shardwise.e2e.kind.images import docker_build

NAMESPACE = "object-store"
NAME = "minio"
PORT = 9000
UID = servers.UID


def image_name() -> str:
    """The image's name, keyed by the MinIO pin (its build folder's hash): a new pin, a new image."""
    return f"shardwise/minio:{s3server.s3_bin_dir().name}"


def build_image(say=print) -> str:
    """The MinIO image (FROM scratch: the binary is static), built once per pin."""
    tag = image_name()
    if image_exists(tag):
        return tag
    binary = s3server.build_s3_server(say)
    with tempfile.TemporaryDirectory(prefix="shardwise-minio-") as ctx:
        shutil.copy2(binary, Path(ctx) / "minio")
        (Path(ctx) / "Dockerfile").write_text(
            f"FROM scratch\nCOPY minio /minio\nUSER {UID}:{UID}\nEXPOSE {PORT}\n"
            'ENTRYPOINT ["/minio"]\n')
        docker_build(Path(ctx) / "Dockerfile", tag, Path(ctx), say)
    return tag


def push_image(say=print) -> str:
    """Build (once) and push the image to the local registry; the name the nodes pull."""
    return registry.push(build_image(say), say)


@dataclass(frozen=True)
class Store:
    """The running server: its in-cluster endpoint and the credentials it accepts."""
    endpoint: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """The credential variables, as a model's Secret holds them."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


def manifests(image: str, access_key: str, secret_key: str) -> list[dict]:
    """The namespace (Pod Security `restricted`), the credentials Secret, the Deployment and Service."""
    container = {
        "args": ["server", "--quiet", "--address", f":{PORT}", "--console-address", ":9001", "/data/store"],
        "env": [{"name": "HOME", "value": "/data"}, {"name": "TMPDIR", "value": "/data"}, {"name": "MINIO_BROWSER", "value": "off"},
                {"name": "MINIO_UPDATE", "value": "off"}, {"name": "CI", "value": "true"},
                *({"name": key, "valueFrom": {"secretKeyRef": {"name": NAME, "key": key}}}
                  for key in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"))],
        "readinessProbe": {"httpGet": {"path": "/minio/health/ready", "port": PORT}, "periodSeconds": 2}}
    return servers.manifests(NAMESPACE, NAME, image, PORT, container, "/data",
                             {"MINIO_ROOT_USER": access_key, "MINIO_ROOT_PASSWORD": secret_key})


def deploy(cluster, image: str) -> Store:
    """Apply the manifests with fresh credentials and wait until the server is Ready."""
    access_key, secret_key = "sw" + secrets.token_hex(8), secrets.token_urlsafe(24)
    servers.deploy(cluster, manifests(image, access_key, secret_key), NAMESPACE, NAME)
    return Store(f"http://{NAME}.{NAMESPACE}.svc.cluster.local:{PORT}", access_key, secret_key)


def remove(cluster) -> None:
    servers.remove(cluster, NAMESPACE)
