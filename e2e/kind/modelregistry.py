"""A model registry inside the kind cluster: the distribution registry (the image of the suite's own
registry, e2e/kind/registry.py) run as e2e/kind/servers.py runs a server, a Deployment and a Service
in namespace `model-registry`, with htpasswd users of its own, serving plain HTTP as a registry
inside a cluster often does. Models are pushed to it through a port-forward with the same client
`shardwise push` uses; pods reach it as `registry.model-registry.svc.cluster.local:5000`, which the
operator speaks plain HTTP to only once its chart lists it (operator.plainHttpRegistries).

    image = modelregistry.push_image()
    reg = modelregistry.deploy(cluster, image)       # waits until it is Ready
    with modelregistry.port_forward(cluster) as host:  # 127.0.0.1:<port>
        push_folder(Registry(host, "models/smollm2", True, *reg.credentials), folder, "v1")
    f"oci://{reg.host}/models/smollm2:v1"
"""
from __future__ import annotations

import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from shardwise.e2e.kind import registry, servers
from shardwise.e2e.localregistry import bcrypt_hash

NAMESPACE = "model-registry"
NAME = "registry"
PORT = 5000
USER = "puller"
_CONFIG = f"""\
version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: /var/lib/registry}}
http: {{addr: ":{PORT}"}}
auth:
  htpasswd: {{realm: model-registry, path: /etc/model-registry/htpasswd}}
"""


@dataclass(frozen=True)
class ModelRegistry:
    host: str            # as the pods name it: host:port
    username: str
    password: str

    @property
    def credentials(self) -> tuple[str, str]:
        return self.username, self.password

    def env(self) -> dict[str, str]:
        """The credential variables, as a model's Secret holds them."""
        return {"OCI_USERNAME": self.username, "OCI_PASSWORD": self.password}


def push_image(say=print) -> str:
    """The suite's registry image (built once), pushed for the nodes to pull."""
    return registry.push(registry.build_image(say), say)


def manifests(image: str, password: str) -> list[dict]:
    container = {
        "args": ["serve", "/etc/model-registry/config.yml"],
        # /v2/ answers 401 with auth on; the port open is Ready enough
        "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 2}}
    return servers.manifests(NAMESPACE, NAME, image, PORT, container, "/var/lib/registry",
                             {"config.yml": _CONFIG, "htpasswd": f"{USER}:{bcrypt_hash(password)}\n"},
                             secret_path="/etc/model-registry")


def deploy(cluster, image: str) -> ModelRegistry:
    """Apply the manifests with a fresh password and wait until the registry is Ready."""
    password = secrets.token_urlsafe(18)
    servers.deploy(cluster, manifests(image, password), NAMESPACE, NAME)
    return ModelRegistry(f"{NAME}.{NAMESPACE}.svc.cluster.local:{PORT}", USER, password)


@contextmanager
def port_forward(cluster) -> Iterator[str]:
    """The registry on this machine's loopback, as host:port (a loopback registry speaks plain HTTP)."""
    with cluster.port_forward(NAMESPACE, f"svc/{NAME}", PORT) as url:
        yield url.split("://", 1)[-1].rstrip("/")


def remove(cluster) -> None:
    servers.remove(cluster, NAMESPACE)
