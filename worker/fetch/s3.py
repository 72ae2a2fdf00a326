"""The `s3://bucket/prefix` store: the objects under a prefix of any S3-compatible endpoint.

Read with boto3: s3fs (fsspec) would let DCP's fsspec writer share the client, but its aiobotocore
pins an exact botocore release other than the one boto3 and the rest of the image carry, so
installing it replaces botocore under them; boto3 is the well-kept client both layers can share.

Credentials come only from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), which
a pod receives from the Secret its spec names. Without them requests go unsigned (a public bucket):
the client never looks further (no ~/.aws, no instance metadata service to hang on). No message
this module raises carries a credential or the server's own error text: only the code it answered.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

from shardwise.crds.modelsource import S3Uri
from shardwise.worker.fetch.remote import (MAX_LISTED_FILES, MAX_MULTIPART_PARTS, MAX_NAME_BYTES,
                                           MAX_STREAMS, READ_CHUNK, Checksum, ChecksumKind, NotFound,
                                           RemoteError, RemoteFile, Unauthorized, Unreachable, busy)

ENV_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
ENV_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_SESSION_TOKEN = "AWS_SESSION_TOKEN"

MULTIPART_ETAG = re.compile(r"([0-9a-f]{32})-([1-9][0-9]{0,4})")
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "NotFound", "404"}
# S3's own codes for "later" (its 5xx and 503 SlowDown); any 5xx or 429 status says the same
_BUSY = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed"}
_UNAUTHORIZED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401",
                 "InvalidToken", "ExpiredToken", "AllAccessDisabled"}


@dataclass(frozen=True)
class S3Config:
    """Where the bucket is served and how long to wait for it. `endpoint` None: AWS itself."""
    endpoint: str | None = None
    region: str = "us-east-1"
    path_style: bool = False          # bucket in the path (MinIO, most on-premises stores)
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0      # a read stalled this long fails (the cache retries it)
    attempts: int = 3                 # the client's own retries of one request


class S3Store:
    """The `Remote` of one `s3://bucket/prefix` (see shardwise.worker.fetch.remote)."""

    def __init__(self, uri: S3Uri, config: S3Config = S3Config(), env: dict[str, str] | None = None):
        self.uri, self.config = uri, config
        self._client = make_client(config, os.environ if env is None else env)
        self._listing: list[RemoteFile] | None = None

    def describe(self) -> str:
        return str(self.uri)

    def _key(self, name: str) -> str:
        return f"{self.uri.prefix}/{name}" if self.uri.prefix else name

    def list_files(self) -> list[RemoteFile]:
        if self._listing is None:
            self._listing = self._list()
        return list(self._listing)

    def _list(self) -> list[RemoteFile]:
        root = f"{self.uri.prefix}/" if self.uri.prefix else ""
        files: list[RemoteFile] = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.uri.bucket, Prefix=root, PaginationConfig={"PageSize": 1000})
        with self._errors():
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(root):]
                    if not name or name.endswith("/"):
                        continue          # a "folder" marker some tools create
                    if len(name.encode()) > MAX_NAME_BYTES:
                        raise RemoteError(f"{self.describe()}: an object name is longer than "
                                          f"{MAX_NAME_BYTES} bytes")
                    files.append(RemoteFile(name, int(obj["Size"]), _etag_checksum(obj.get("ETag"))))
                    if len(files) > MAX_LISTED_FILES:
                        raise RemoteError(f"{self.describe()}: more than {MAX_LISTED_FILES} objects "
                                          "under the prefix")
        if not files:
            raise NotFound(f"{self.describe()}: no objects under the prefix")
        return sorted(files, key=lambda f: f.name)

    def revision(self) -> str:
        """A digest of the listing's (name, size, ETag): a rewritten object is a new revision."""
        h = hashlib.sha256()
        for f in self.list_files():
            h.update(f"{f.name}\0{f.size}\0{f.checksum.value if f.checksum else ''}\n".encode())
        return "listing-" + h.hexdigest()[:32]

    def read(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if end is not None and end <= start:
            return
        # No Range for a whole object: a store answers an empty object's "bytes=0-" with 416.
        ranged = {"Range": f"bytes={start}-" + (str(end - 1) if end is not None else "")} \
            if start or end is not None else {}
        with self._errors(name):
            body = self._client.get_object(Bucket=self.uri.bucket, Key=self._key(name), **ranged)["Body"]
            try:
                yield from body.iter_chunks(READ_CHUNK)
            finally:
                body.close()

    def part_sizes(self, name: str, size: int, parts: int, exact: bool = False) -> list[int]:
        """The sizes of the parts a multipart object was uploaded in (remote.PartSized): HeadObject
        with PartNumber answers that part's ContentLength (the ETag does not say it)."""
        if not 1 <= parts <= MAX_MULTIPART_PARTS:
            raise RemoteError(f"{self.describe()}/{name}: {parts} parts is not a multipart upload")
        first = self._part_length(name, 1)
        if not exact and first > 0 and -(-size // first) == parts:
            return [first] * (parts - 1) + [size - first * (parts - 1)]
        sizes = [first] + [self._part_length(name, n) for n in range(2, parts + 1)]
        if sum(sizes) != size:
            raise RemoteError(f"{self.describe()}/{name}: the store's part sizes add up to "
                              f"{sum(sizes)} bytes, not the {size} it listed")
        return sizes

    def _part_length(self, name: str, number: int) -> int:
        with self._errors(name):
            head = self._client.head_object(Bucket=self.uri.bucket, Key=self._key(name), PartNumber=number)
        length = head.get("ContentLength")
        if not isinstance(length, int) or length < 0:
            raise RemoteError(f"{self.describe()}/{name}: the store answered no size for part {number}")
        return length

    def _errors(self, name: str | None = None):
        return _mapped_errors(self.describe() + (f"/{name}" if name else ""))


def make_client(config: S3Config, env: Any) -> Any:
    """A boto3 S3 client for `config`, signed with the credentials in `env` (unsigned without)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    access, secret = env.get(ENV_ACCESS_KEY), env.get(ENV_SECRET_KEY)
    signed = bool(access and secret)
    client_config = Config(
        region_name=config.region, connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s, max_pool_connections=MAX_STREAMS, retries={"max_attempts": config.attempts, "mode": "standard"},
        s3={"addressing_style": "path" if config.path_style else "auto"},
        # Many S3-compatible stores answer no CRC checksums: verify what the cache can (MD5, size).
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
        **({} if signed else {"signature_version": UNSIGNED}))
    session = boto3.session.Session(
        aws_access_key_id=access if signed else None, aws_secret_access_key=secret if signed else None,
        aws_session_token=env.get(ENV_SESSION_TOKEN) if signed else None, region_name=config.region)
    return session.client("s3", endpoint_url=config.endpoint, config=client_config)


def _etag_checksum(etag: str | None) -> Checksum | None:
    """A single-part upload's ETag is the object's MD5; a multipart one ('<hex>-<parts>') the MD5 of
    its parts' MD5s."""
    if not etag:
        return None
    value = etag.strip('"').lower()
    if len(value) == 32 and all(c in "0123456789abcdef" for c in value):
        return Checksum(ChecksumKind.MD5, value)
    m = MULTIPART_ETAG.fullmatch(value)
    if m and int(m.group(2)) <= MAX_MULTIPART_PARTS:
        return Checksum(ChecksumKind.S3_MULTIPART_MD5, value)
    return Checksum(ChecksumKind.OPAQUE, value[:200])


class _mapped_errors:
    """Turns botocore's exceptions into the store errors, one line each, no server text."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, RemoteError) or not isinstance(error, Exception):
            return False
        from botocore import exceptions as bx

        if isinstance(error, bx.ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = str(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _NOT_FOUND or status == "404":
                raise NotFound(f"{self.what}: not found ({code or status})") from None
            if code in _UNAUTHORIZED or status in ("401", "403"):
                raise Unauthorized(f"{self.what}: access denied ({code or status}); check the "
                                   f"credentials in {ENV_ACCESS_KEY} / {ENV_SECRET_KEY}") from None
            later = code in _BUSY or (status.isdigit() and busy(int(status)))
            raise (Unreachable if later else RemoteError)(
                f"{self.what}: the store answered {code or status or 'an error'}") from None
        if isinstance(error, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
            raise Unreachable(f"{self.what}: timed out waiting for the store") from None
        if isinstance(error, bx.EndpointConnectionError):
            raise Unreachable(f"{self.what}: cannot reach the endpoint") from None
        if isinstance(error, (bx.ConnectionError, ConnectionError, TimeoutError)):
            raise Unreachable(f"{self.what}: {type(error).__name__} talking to the store") from None
        if isinstance(error, (bx.BotoCoreError, OSError)):
            raise RemoteError(f"{self.what}: {type(error).__name__} talking to the store") from None
        return False
