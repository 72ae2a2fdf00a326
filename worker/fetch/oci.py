"""The OCI registry store behind `oci://registry/repository:tag` (or `@sha256:...`): a model pushed as
an OCI artifact, the way ORAS pushes files: an image manifest whose layers are the model's files, each
annotated `org.opencontainers.image.title` with the file's name relative to the model's root.

The manifest the tag names is read once (bounded, its digest computed from its bytes): that digest
is the revision, so a moved tag is a new cache entry, and a uri pinned by digest is checked against
the bytes. Each layer's digest is its file's sha256 checksum, recomputed by the cache over the
bytes it writes; byte
ranges are Range requests on the blob. A layer count, name, size or digest that is not what a model
artifact holds is refused in one line: nothing a registry answers is trusted.
"""
from __future__ import annotations

import os
from typing import Iterator

from shardwise.crds import boundedjson
from shardwise.worker.fetch import trust
from shardwise.worker.fetch.ranged import body_slice, range_header
from shardwise.worker.fetch.registry import DIGEST, INDEX_TYPES, Registry
from shardwise.worker.fetch.remote import (
    Checksum, ChecksumKind, NotFound, RemoteError, RemoteFile,
)

# Where a pod (from the Secret its spec names) and `shardwise push` find the registry's credentials.
ENV_USERNAME = "OCI_USERNAME"
ENV_PASSWORD = "OCI_PASSWORD"
TITLE = "org.opencontainers.image.title"
# What the pusher writes as the manifest's artifactType; a pull accepts any (ORAS's own included).
ARTIFACT_TYPE = "application/vnd.shardwise.model.v1"
# More layers than this is not a model: the largest checkpoints have a few hundred shard files.
MAX_LAYERS = 10_000
# A manifest nests 4 deep (layers, a descriptor, its annotations); an index's platforms one more.
MAX_JSON_DEPTH = 8
# ORAS marks a layer that is a packed directory; the store reads files, not archives.
_ORAS_UNPACK = "io.deis.oras.content.unpack"


class OciRemote:
    """A model artifact in one repository of a registry, at a tag or a manifest digest. Without a
    username the constructor takes OCI_USERNAME / OCI_PASSWORD from the environment (anonymous when
    unset)."""

    def __init__(self, host: str, repository: str, reference: str = "latest",
                 plain_http: bool = False, username: str | None = None,
                 password: str | None = None, timeout_s: float | None = None):
        self.reference = reference
        if username is None:
            username, password = os.environ.get(ENV_USERNAME) or None, os.environ.get(ENV_PASSWORD)
        kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
        self._registry = Registry(host, repository, plain_http, username, password, **kwargs)
        self._digest: str | None = None
        self._files: dict[str, tuple[RemoteFile, str]] | None = None    # name -> (file, layer digest)

    def __repr__(self) -> str:       # never the password
        return f"OciRemote({self.describe()!r})"

    def describe(self) -> str:
        sep = "@" if self.reference.startswith("sha256:") else ":"
        return f"{self._registry.where()}{sep}{self.reference}"

    def revision(self) -> str:
        self._load()
        return self._digest  # type: ignore[return-value]

    def list_files(self) -> list[RemoteFile]:
        self._load()
        return [f for f, _ in self._files.values()]  # type: ignore[union-attr]

    def read(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        self._load()
        entry = self._files.get(name)  # type: ignore[union-attr]
        if entry is None:
            raise NotFound(f"{self.describe()}: no file {name[:200]!r} in the artifact")
        f, digest = entry
        end = f.size if end is None else min(end, f.size)
        if not 0 <= start <= end:
            raise RemoteError(f"{self.describe()}: bad byte range [{start}, {end}) of {name}")
        return self._stream(f, digest, start, end)

    def _stream(self, f: RemoteFile, digest: str, start: int, end: int) -> Iterator[bytes]:
        if start == end:
            return
        where = f"{self.describe()} {f.name}"
        with self._registry.blob(digest, range_header(start, end, f.size)) as response:
            # the bytes are checked against the layer digest once, by the cache that writes them
            yield from body_slice(response, start, end, where)

    def _load(self) -> None:
        if self._files is not None:
            return
        digest, body, media = self._registry.manifest(self.reference)
        manifest = self._parse(body, media)
        files = [self._layer(i, layer) for i, layer in enumerate(manifest["layers"])]
        listed = trust.checked_listing(self.describe(), [f for f, _ in files])
        by_name = {f.name: (f, d) for f, d in files}
        self._files = {f.name: by_name[f.name] for f in listed}
        self._digest = digest

    def _parse(self, body: bytes, media: str) -> dict:
        where = self.describe()
        try:
            manifest = boundedjson.loads(body, MAX_JSON_DEPTH)
        except boundedjson.JSONRefused as e:
            raise RemoteError(f"{where}: the manifest {e}") from None
        if not isinstance(manifest, dict):
            raise RemoteError(f"{where}: the manifest is not a JSON object")
        if media in INDEX_TYPES or manifest.get("mediaType") in INDEX_TYPES:
            raise RemoteError(f"{where}: the tag names an image index (a multi-platform image), not "
                              "a model artifact; push the model's files as one artifact (shardwise "
                              "oci push)")
        layers = manifest.get("layers")
        if manifest.get("schemaVersion") != 2 or not isinstance(layers, list):
            raise RemoteError(f"{where}: not an OCI image manifest (schemaVersion 2 with layers)")
        if not layers or len(layers) > MAX_LAYERS:
            raise RemoteError(f"{where}: the artifact has {len(layers)} layers; a model artifact has "
                              f"1 to {MAX_LAYERS}")
        return manifest

    def _layer(self, index: int, layer: object) -> tuple[RemoteFile, str]:
        where = f"{self.describe()}: layer {index}"
        if not isinstance(layer, dict):
            raise RemoteError(f"{where} is not a descriptor")
        annotations = layer.get("annotations") if isinstance(layer.get("annotations"), dict) else {}
        name = annotations.get(TITLE)
        if name is None:
            raise RemoteError(f"{where} has no {TITLE} annotation: not a model artifact pushed as "
                              "files (a container image is not read by oci://)")
        if str(annotations.get(_ORAS_UNPACK, "")).lower() == "true":
            raise RemoteError(f"{where} ({str(name)[:80]}) is a packed directory; push the files")
        digest = layer.get("digest")
        m = DIGEST.fullmatch(digest) if isinstance(digest, str) else None
        if m is None:
            raise RemoteError(f"{where} has no sha256 digest")
        f = trust.checked_file(self.describe(), name, layer.get("size"),
                               Checksum(ChecksumKind.SHA256, m.group(1)))
        return f, digest  # type: ignore[return-value]
