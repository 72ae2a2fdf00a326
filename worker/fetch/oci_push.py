"""Push a model folder to a registry as an OCI artifact that `oci://` reads, the way ORAS pushes files:
one layer per file (its bytes as they are, media type application/vnd.oci.image.layer.v1.tar, ORAS's
default for a file), annotated `org.opencontainers.image.title` with the path relative to the folder,
an empty config, and the artifact type application/vnd.shardwise.model.v1. `oras pull` gets the same
folder back, and a blob the registry already holds is not uploaded again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from shardwise.worker.fetch import trust
from shardwise.worker.fetch.oci import ARTIFACT_TYPE, MAX_LAYERS, TITLE
from shardwise.worker.fetch.registry import MANIFEST_TYPES, Registry
from shardwise.worker.fetch.remote import RemoteError

LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
# The OCI empty descriptor: the config of an artifact that has none.
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json",
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
                "size": 2}
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class Pushed:
    digest: str           # the manifest's digest: pin the uri to it with oci://host/repo@<digest>
    files: int
    bytes_total: int
    bytes_uploaded: int   # less than bytes_total when the registry already held some blobs


def push_folder(registry: Registry, folder: Path, tag: str) -> Pushed:
    """Upload every file under `folder` and tag the manifest naming them."""
    folder = Path(folder)
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    if not paths:
        raise RemoteError(f"{folder}: no files to push")
    if len(paths) > MAX_LAYERS:
        raise RemoteError(f"{folder}: {len(paths)} files; an artifact holds at most {MAX_LAYERS}")
    layers, uploaded = [], 0
    for path in paths:
        name = path.relative_to(folder).as_posix()
        problem = trust.name_problem(name)
        if problem:
            raise RemoteError(f"{folder}: cannot push {problem}")
        size, digest = path.stat().st_size, _sha256(path)
        if not registry.has_blob(digest):
            with open(path, "rb") as f:
                registry.upload_blob(digest, size, f)
            uploaded += size
        layers.append({"mediaType": LAYER_TYPE, "digest": digest, "size": size,
                       "annotations": {TITLE: name}})
    if not registry.has_blob(EMPTY_CONFIG["digest"]):
        registry.upload_blob(EMPTY_CONFIG["digest"], 2, b"{}")
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0], "artifactType": ARTIFACT_TYPE,
                "config": EMPTY_CONFIG, "layers": layers}
    body = json.dumps(manifest, separators=(",", ":")).encode()
    registry.put_manifest(tag, body, MANIFEST_TYPES[0])
    return Pushed("sha256:" + hashlib.sha256(body).hexdigest(), len(layers),
                  sum(layer["size"] for layer in layers), uploaded)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
