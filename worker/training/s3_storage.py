"""DCP's storage writer and reader for a folder of an S3-compatible bucket, on the boto3 client of
worker/fetch/s3.py (the same credentials rule, timeouts and one-line errors as `model.uri: s3://`).

They are DCP's own FileSystemWriter / FileSystemReader with their `fs` swapped for S3Folder, an
implementation of DCP's FileSystemBase over object keys: a written file is buffered (in memory,
spilling to a temporary file past SPOOL_BYTES) and uploaded as one object when DCP closes it; a
read file is fetched by ranged GETs through a buffer, so a resharded resume reads only the byte
ranges of the chunks it needs. DCP's `.metadata` is read through checkpoint_metadata's restricted
unpickler, never pickle.load: a bucket's content is not trusted.

AWS's s3torchconnector (DCP S3StorageWriter/S3StorageReader) was tried first: it reaches a
loopback MinIO only by replacing its writer's private `fs` after construction (version 1.5 takes no
endpoint), its native client takes credentials from the whole AWS chain (~/.aws, instance
metadata) where shardwise takes them only from the environment the pod receives from its Secret,
and its reader unpickles the metadata; the same two DCP classes over the boto3 client shardwise
already carries need none of that.
"""
from __future__ import annotations

import io
import posixpath
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemBase

from shardwise.worker.fetch.remote import NotFound
from shardwise.worker.fetch.s3 import _mapped_errors as mapped_errors
from shardwise.worker.weights.checkpoint_metadata import METADATA_FILE, load_metadata_stream

SPOOL_BYTES = 64 * 1024 * 1024       # a written file past this is buffered on disk, not in memory
READ_BUFFER = 8 * 1024 * 1024        # bytes fetched per ranged GET when DCP reads a file


def no_expect_for_empty(request: Any, **_: Any) -> None:
    """boto3 sends an empty PUT with 'Expect: 100-continue'; MinIO answers without a 100 and the
    pooled connection's next request then waits about 30 s. An empty body has nothing to hold back."""
    if request.headers.get("Content-Length") in ("0", b"0"):
        request.headers.pop("Expect", None)


def prepare_client(client: Any) -> Any:
    """A client of worker/fetch/s3.make_client, made fit for writing objects of any size."""
    client.meta.events.register("before-send.s3.PutObject", no_expect_for_empty)
    return client




class _Spool(tempfile.SpooledTemporaryFile):
    """A written file's buffer that outlives DCP closing it: it is uploaded afterwards."""

    def close(self) -> None:
        return None

    def discard(self) -> None:
        tempfile.SpooledTemporaryFile.close(self)


class _RangedRaw(io.RawIOBase):
    """One object read by ranged GETs (seekable, so DCP can jump to a chunk's offset)."""

    def __init__(self, folder: "S3Folder", key: str, size: int):
        self.folder, self.key, self.size, self.pos = folder, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self.pos + len(buffer))
        if end <= self.pos:
            return 0
        with self.folder.errors(self.key):
            body = self.folder.client.get_object(Bucket=self.folder.bucket, Key=self.key,
                                                 Range=f"bytes={self.pos}-{end - 1}")["Body"]
            try:
                data = body.read()
            finally:
                body.close()
        n = len(data)
        buffer[:n] = data
        self.pos += n
        return n


class S3Folder(FileSystemBase):
    """DCP's FileSystemBase over the keys of one bucket; a path is a key ('prefix/step-…/file')."""

    def __init__(self, client: Any, bucket: str):
        self.client, self.bucket = client, bucket

    def errors(self, key: str) -> Any:
        return mapped_errors(f"s3://{self.bucket}/{key}")

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        key = str(path)
        if mode == "rb":
            with self.errors(key):
                size = int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
            with io.BufferedReader(_RangedRaw(self, key, size), READ_BUFFER) as stream:
                yield stream
            return
        if mode != "wb":
            raise ValueError(f"S3Folder streams are 'rb' or 'wb', not {mode!r}")
        buffer = _Spool(max_size=SPOOL_BYTES)
        try:
            yield buffer
            buffer.seek(0)
            with self.errors(key):   # a managed upload: multipart past its threshold
                self.client.upload_fileobj(buffer, self.bucket, key)
        finally:
            buffer.discard()

    def concat_path(self, path: Any, suffix: str) -> str:
        return posixpath.join(str(path), suffix)

    def rename(self, path: Any, new_path: Any) -> None:
        """Only DCP's `.metadata.tmp` -> `.metadata` (a small object): copy, then delete."""
        with self.errors(str(path)):
            self.client.copy_object(Bucket=self.bucket, Key=str(new_path),
                                    CopySource={"Bucket": self.bucket, "Key": str(path)})
            self.client.delete_object(Bucket=self.bucket, Key=str(path))

    def init_path(self, path: Any) -> str:
        return str(path).strip("/")

    def mkdir(self, path: Any) -> None:
        return None   # a store has no folders: a key's prefix exists once an object has it

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False   # never picked by DCP's own guessing: only handed in explicitly

    def exists(self, path: Any) -> bool:
        try:
            with self.errors(str(path)):
                self.client.head_object(Bucket=self.bucket, Key=str(path))
        except NotFound:
            return False
        return True

    def rm_file(self, path: Any) -> None:
        with self.errors(str(path)):
            self.client.delete_object(Bucket=self.bucket, Key=str(path))


class S3StorageWriter(dcp.FileSystemWriter):
    """DCP's writer into `s3://<bucket>/<key_prefix>/` (one object per rank, then `.metadata`)."""

    def __init__(self, client: Any, bucket: str, key_prefix: str):
        super().__init__(key_prefix, sync_files=False)   # an object is durable once its PUT answered
        self.fs = S3Folder(client, bucket)
        self.path = self.fs.init_path(key_prefix)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class S3StorageReader(dcp.FileSystemReader):
    """DCP's reader of `s3://<bucket>/<key_prefix>/`; the metadata through the restricted loader."""

    def __init__(self, client: Any, bucket: str, key_prefix: str):
        super().__init__(key_prefix)
        self.fs = S3Folder(client, bucket)
        self.path = self.fs.init_path(key_prefix)
        self.bucket = bucket
        self._metadata: dcp_metadata.Metadata | None = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is None:
            key = self.fs.concat_path(self.path, METADATA_FILE)
            where = f"s3://{self.bucket}/{key}"
            with self.fs.create_stream(key, "rb") as stream:
                self._metadata = load_metadata_stream(stream, stream.raw.size, where)
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
