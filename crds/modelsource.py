"""The one parser of `model.uri`: which scheme it names and that scheme's parts, or one line saying
what is wrong with it.

    /models/llama                          a path inside the pod
    pvc://claim/path                       a PersistentVolumeClaim, mounted read-only
    hf://org/name[@revision][/file.gguf]   a Hugging Face Hub repository (a named .gguf inside)
    s3://bucket[/prefix]                   the objects under a prefix of an S3-compatible bucket
    oci://registry[:port]/repo:tag         a model pushed as an OCI artifact (or @sha256:<digest>)

Everything a user writes here reaches a store and a cache folder name, so each part is bounded and
checked against its store's own grammar, and no part may climb out of its root ('..').
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Union

from shardwise.crds.apimodel import malformed_pvc, parse_pvc

MAX_URI_CHARS = 4096          # the spec field's own bound
MAX_KEY_CHARS = 1024          # an S3 key or an in-repo file path (S3's own limit on a key)


class SourceScheme(str, enum.Enum):
    PATH = "path"
    PVC = "pvc"
    HF = "hf"
    S3 = "s3"
    OCI = "oci"


class ModelUriError(ValueError):
    """The uri cannot name a model; the message is one line naming the part that is wrong."""


@dataclass(frozen=True)
class PathUri:
    path: str
    scheme = SourceScheme.PATH

    @property
    def location(self) -> str:
        return self.path


@dataclass(frozen=True)
class PvcUri:
    claim: str
    path: str
    scheme = SourceScheme.PVC

    @property
    def location(self) -> str:
        return f"{self.claim}/{self.path}"


@dataclass(frozen=True)
class HfUri:
    repo: str                      # org/name
    revision: str | None = None    # a branch, tag or commit; None: the repository's default branch
    file: str | None = None        # a .gguf file inside the repository; None: the safetensors folder
    scheme = SourceScheme.HF

    @property
    def location(self) -> str:
        return self.repo + (f"/{self.file}" if self.file else "")

    def __str__(self) -> str:
        return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision else "") + \
            (f"/{self.file}" if self.file else "")


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str = ""               # '' (the whole bucket) or 'a/b' (no leading or trailing '/')
    scheme = SourceScheme.S3

    @property
    def location(self) -> str:
        return self.bucket + (f"/{self.prefix}" if self.prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.location}"


@dataclass(frozen=True)
class OciUri:
    registry: str                  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None      # sha256:<64 hex>; pins the content even if the tag moves
    scheme = SourceScheme.OCI

    @property
    def location(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        return f"oci://{self.location}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


ParsedUri = Union[PathUri, PvcUri, HfUri, S3Uri, OciUri]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31})://")
# The Hub's repository names: letters, digits, '-', '_', '.', at most 96, no '--' or '..' inside.
_HF_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
# S3's bucket naming rules (lower case, 3-63, no '..', not an IP address).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
# The OCI distribution grammar: host[:port], path components, tag, digest.
_REGISTRY = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*(?::(\d{1,5}))?$")
_OCI_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_OCI_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")


def scheme_of(uri: str) -> str:
    """The scheme a uri is written with ("s3", "pvc", ... or "" for a path), before any other check:
    what the API's rules (crds/sourcespec.py) branch on."""
    m = _SCHEME.match(uri) if isinstance(uri, str) else None
    return m.group(1) if m else ""


def parse_model_uri(uri: str) -> ParsedUri:
    """The parsed form of `uri`; ModelUriError (one line) when it is not a model this project reads."""
    if not isinstance(uri, str) or not uri:
        raise ModelUriError("model.uri is empty")
    if len(uri) > MAX_URI_CHARS:
        raise ModelUriError(f"model.uri is {len(uri)} characters, more than {MAX_URI_CHARS}")
    if not uri.isprintable() or any(c.isspace() for c in uri):
        raise ModelUriError("model.uri holds a space or a control character")
    m = _SCHEME.match(uri)
    if not m:
        return PathUri(uri)
    scheme, rest = m.group(1), uri[m.end():]
    parse = _PARSERS.get(scheme)
    if parse is None:
        raise ModelUriError(f"model.uri scheme {scheme!r}:// is not one of pvc://, hf://, s3://, oci:// "
                            "(or a path inside the pod)")
    return parse(uri, rest)


def _relative_path(what: str, path: str) -> str:
    """A '/'-separated path under a root: no empty, '.' or '..' segment; bounded."""
    if len(path.encode()) > MAX_KEY_CHARS:
        raise ModelUriError(f"{what} is longer than {MAX_KEY_CHARS} bytes")
    for seg in path.split("/"):
        if seg in ("", ".", ".."):
            raise ModelUriError(f"{what} {path!r} has an empty, '.' or '..' segment")
    return path


def _pvc(uri: str, rest: str) -> PvcUri:
    if malformed_pvc(uri):
        raise ModelUriError("model.uri must look like pvc://<claim>/<path> when it starts with pvc://")
    claim, path = parse_pvc(uri) or ("", "")
    return PvcUri(claim, path)


def _hf(uri: str, rest: str) -> HfUri:
    parts = rest.split("/", 2)
    if len(parts) < 2:
        raise ModelUriError(f"model.uri {uri!r} must look like hf://<org>/<name>[@revision][/<file>.gguf]")
    org, name = parts[0], parts[1]
    revision = None
    if "@" in name:
        name, _, revision = name.partition("@")
        if not _HF_REVISION.match(revision) or ".." in revision:
            raise ModelUriError(f"model.uri revision {revision!r} is not a branch, tag or commit name "
                                "(letters, digits, '.', '_', '-'; at most 100)")
    for what, part in (("organisation", org), ("repository name", name)):
        if not _HF_PART.match(part) or "--" in part or ".." in part:
            raise ModelUriError(f"model.uri {what} {part!r} is not a Hugging Face Hub name")
    file = _relative_path("model.uri file", parts[2]) if len(parts) == 3 else None
    if file is not None and not file.endswith(".gguf"):
        raise ModelUriError(f"model.uri names {file!r} inside the repository; only a .gguf file can be "
                            "named (leave it out for a safetensors repository)")
    return HfUri(f"{org}/{name}", revision, file)


def _s3(uri: str, rest: str, field: str = "model.uri") -> S3Uri:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ModelUriError(f"{field} s3:// names no bucket (s3://<bucket>/<prefix>)")
    if not _BUCKET.match(bucket) or ".." in bucket or _IPV4.match(bucket):
        raise ModelUriError(f"{field} bucket {bucket!r} is not an S3 bucket name "
                            "(3-63 of a-z, 0-9, '.', '-')")
    prefix = prefix.rstrip("/")
    return S3Uri(bucket, _relative_path(f"{field} prefix", prefix) if prefix else "")


def parse_s3_uri(uri: str, field: str) -> S3Uri:
    """`s3://bucket/prefix` of a field other than model.uri (checkpoint.uri), by the same rules;
    ModelUriError (one line, naming `field`) otherwise."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ModelUriError(f"{field} must be s3://<bucket>/<prefix>")
    if len(uri) > MAX_URI_CHARS or not uri.isprintable() or any(c.isspace() for c in uri):
        raise ModelUriError(f"{field} is longer than {MAX_URI_CHARS} characters or holds a space or control character")
    return _s3(uri, uri[len("s3://"):], field)


def is_registry(host: str) -> bool:
    """Whether `host` is an OCI registry's host[:port] (a DNS name or IPv4 address, a port 1-65535)."""
    rm = _REGISTRY.match(host) if isinstance(host, str) else None
    return bool(rm) and len(host) <= 255 and not (rm.group(1) and not 0 < int(rm.group(1)) < 65536)


def registry_key(host: str) -> str:
    """The form two spellings of one registry's host[:port] share: host names are case-insensitive."""
    return host.lower()


def _oci(uri: str, rest: str) -> OciUri:
    registry, slash, ref = rest.partition("/")
    if not slash or not ref:
        raise ModelUriError(f"model.uri {uri!r} must look like oci://<registry>/<repository>:<tag>")
    if not is_registry(registry):
        raise ModelUriError(f"model.uri registry {registry!r} is not a host[:port]")
    tag = digest = None
    if "@" in ref:
        ref, _, digest = ref.partition("@")
        if not _OCI_DIGEST.match(digest):
            raise ModelUriError(f"model.uri digest {digest!r} is not sha256:<64 lower-case hex>")
    else:
        last = ref.rsplit("/", 1)[-1]
        if ":" in last:
            ref, _, tag = ref.rpartition(":")
            if not _OCI_TAG.match(tag):
                raise ModelUriError(f"model.uri tag {tag!r} is not an OCI tag (at most 128 of A-Z a-z 0-9 . _ -)")
        else:
            raise ModelUriError(f"model.uri {uri!r} names no tag or digest (add :<tag> or @sha256:<digest>)")
    if len(ref) > 255 or not all(_OCI_COMPONENT.match(c) for c in ref.split("/")):
        raise ModelUriError(f"model.uri repository {ref!r} is not an OCI repository name "
                            "(lower-case components separated by '/', at most 255)")
    return OciUri(registry, ref, tag, digest)


_PARSERS = {"pvc": _pvc, "hf": _hf, "s3": _s3, "oci": _oci}
