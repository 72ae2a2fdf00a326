"""The shared checkpoint tier in an object store: `s3://bucket/prefix` on any S3-compatible
endpoint, the durable tier beside or instead of a claim. It answers the calls ClaimStore answers
(checkpoint.py), so CheckpointManager saves, prunes and resumes (resharded) the same way.

Layout. A store has no rename, so a step is made visible by one object written last instead:

    <prefix>/step-NNNNNNNN/<attempt>/   DCP's files (one per rank, `.metadata`), meta.json, the model's files
    <prefix>/step-NNNNNNNN/COMPLETE     the marker: the attempt whose copy is committed, its files and sizes

Every rank writes into its run's attempt folder; once all are written and rank 0 has put meta.json,
rank 0 lists the folder and puts the marker, conditionally (If-None-Match: *), so the first commit
of a step wins and a later writer of the same step drops its own copy, as a rename that never
replaces does on a claim. A reader lists only steps whose marker exists and checks the marker's
files against the listing (checkpoint_format.check_complete): a step cut off anywhere before its
marker is never loaded. Keep-N deletes a step's marker first (it vanishes at once), then its
objects. Attempt folders no marker names are removed by their own run at once and by any other
run once stale (checkpoint.is_own_or_stale), so a live run's write is never touched.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwise.crds.modelsource import S3Uri
from shardwise.worker.fetch.remote import RemoteError
from shardwise.worker.fetch.s3 import S3Config, make_client
from shardwise.worker.fetch.s3 import _mapped_errors as mapped_errors
from shardwise.worker.training import s3_storage
from shardwise.worker.training.checkpoint import (
    MARKER, META, STALE_TEMP_S, STEP_DIR, CheckpointError, Slice, is_own_or_stale, marker_record, read_slices,
    step_dir_name, to_prune)
from shardwise.worker.weights.checkpoint_format import check_complete
from shardwise.worker.weights.checkpoint_metadata import UnsafeCheckpoint

MAX_OBJECTS = 1_000_000        # objects listed under a prefix before the store is refused as not ours
MAX_SMALL_OBJECT = 16 << 20    # a marker or meta.json larger than this is not one of ours
DELETE_BATCH = 1000            # keys per DeleteObjects request (the API's limit)


@dataclass
class _Step:
    marker: bool = False
    attempts: dict[str, dict[str, int]] = field(default_factory=dict)   # attempt -> file -> size
    touched: dict[str, float] = field(default_factory=dict)             # attempt -> newest write (unix)


class S3CheckpointStore:
    """The checkpoints under one `s3://bucket/prefix`."""

    def __init__(self, uri: S3Uri, config: S3Config = S3Config(), env: dict[str, str] | None = None,
                 client: Any = None):
        self.uri, self.bucket = uri, uri.bucket
        self.client = s3_storage.prepare_client(
            client or make_client(config, os.environ if env is None else env))

    def __str__(self) -> str:
        return str(self.uri)

    # -- keys
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.uri.prefix, *parts) if p)

    def _data(self, step: int, attempt: str) -> str:
        return self._key(step_dir_name(step), attempt)

    def where(self, step: int) -> str:
        return f"s3://{self.bucket}/{self._key(step_dir_name(step))}"

    def _errors(self, what: str) -> Any:
        return mapped_errors(f"s3://{self.bucket}/{what}")

    # -- small objects
    def _put(self, key: str, body: bytes, **conditions: str) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **conditions)

    def _get_json(self, key: str) -> dict:
        with self._errors(key):
            obj = self.client.get_object(Bucket=self.bucket, Key=key)
            if int(obj.get("ContentLength", 0)) > MAX_SMALL_OBJECT:
                obj["Body"].close()
                raise CheckpointError(f"s3://{self.bucket}/{key} is larger than a checkpoint's {MAX_SMALL_OBJECT} bytes")
            body = obj["Body"].read(MAX_SMALL_OBJECT + 1)
        try:
            value = json.loads(body)
        except ValueError:
            raise CheckpointError(f"s3://{self.bucket}/{key} is not JSON") from None
        if not isinstance(value, dict):
            raise CheckpointError(f"s3://{self.bucket}/{key} is not a JSON object")
        return value

    # -- listing
    def _listing(self, under: str = "") -> dict[int, _Step]:
        """Every step folder under the prefix (or under `under` inside it): whether its marker
        exists, its attempts' files."""
        root = self._key() + "/" if self.uri.prefix else ""
        steps: dict[int, _Step] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + under)
        seen = 0
        with self._errors(root.rstrip("/")):
            for page in pages:
                for obj in page.get("Contents", []):
                    seen += 1
                    if seen > MAX_OBJECTS:
                        raise RemoteError(f"{self.uri}: more than {MAX_OBJECTS} objects under the prefix")
                    self._place(steps, obj["Key"][len(root):], obj)
        return steps

    @staticmethod
    def _place(steps: dict[int, _Step], name: str, obj: dict) -> None:
        parts = name.split("/", 2)
        m = STEP_DIR.match(parts[0])
        if not m or len(parts) < 2:
            return
        step = steps.setdefault(int(m.group(1)), _Step())
        if len(parts) == 2:
            step.marker = step.marker or parts[1] == MARKER
            return
        attempt, file = parts[1], parts[2]
        step.attempts.setdefault(attempt, {})[file] = int(obj["Size"])
        when = obj["LastModified"].timestamp()
        step.touched[attempt] = max(step.touched.get(attempt, 0.0), when)

    def _files(self, step: int, attempt: str) -> dict[str, int]:
        """Name -> size of what one attempt has written of a step."""
        under = f"{step_dir_name(step)}/{attempt}/"
        return self._listing(under).get(step, _Step()).attempts.get(attempt, {})

    # -- the calls of a store (see checkpoint.ClaimStore)
    def open(self, attempt: str) -> None:
        """Rank 0, once per run: the bucket answers, and cut-off writes are cleared."""
        self.clean(attempt)

    def begin(self, step: int, attempt: str, coordinator: bool) -> None:
        """Clear this run's own earlier try at the step (no other run writes into its attempt)."""
        if coordinator:
            self._delete_prefix(self._data(step, attempt) + "/")

    def writer(self, step: int, attempt: str) -> s3_storage.S3StorageWriter:
        return s3_storage.S3StorageWriter(self.client, self.bucket, self._data(step, attempt))

    def commit(self, step: int, attempt: str, meta: dict, files: dict[str, bytes]) -> bool:
        """meta.json and the model's files beside DCP's, then the marker, put only if none exists.
        True if this attempt's copy is the committed one; False if the step was committed already."""
        data = self._data(step, attempt)
        for name, content in {**files, META: json.dumps(meta, indent=1, sort_keys=True).encode()}.items():
            self._put(f"{data}/{name}", content)
        written = self._files(step, attempt)
        marker = json.dumps(marker_record(step, written, attempt), sort_keys=True).encode()
        key = self._key(step_dir_name(step), MARKER)
        try:
            self._put(key, marker, IfNoneMatch="*")
        except RemoteError as e:
            if "PreconditionFailed" not in str(e) and "412" not in str(e):
                raise
            self._delete_prefix(data + "/")   # the first commit of the step won: drop this copy
            return False
        return True

    def steps(self) -> list[int]:
        """Committed steps (marker present), oldest first; CheckpointError if the store fails."""
        try:
            return sorted(step for step, s in self._listing().items() if s.marker)
        except RemoteError as e:
            raise CheckpointError(str(e)) from None

    def _committed_attempt(self, step: int) -> tuple[dict, str]:
        marker = self._get_json(self._key(step_dir_name(step), MARKER))
        attempt = marker.get("attempt")
        if not isinstance(attempt, str) or not attempt or "/" in attempt:
            raise CheckpointError(f"checkpoint {self.where(step)}: its marker names no attempt")
        return marker, attempt

    def verify(self, step: int) -> dict:
        """The marker's files against the listing (sizes), then meta.json; CheckpointError if not complete."""
        where = self.where(step)
        try:
            marker, attempt = self._committed_attempt(step)
            meta = self._get_json(f"{self._data(step, attempt)}/{META}")
            sizes = self._files(step, attempt)
        except RemoteError as e:
            raise CheckpointError(f"checkpoint {where}: {e}") from None
        check_complete(where, marker, meta, sizes)
        return meta

    def _reader(self, step: int) -> s3_storage.S3StorageReader:
        try:
            _, attempt = self._committed_attempt(step)
            reader = s3_storage.S3StorageReader(self.client, self.bucket, self._data(step, attempt))
            reader.read_metadata()   # checked (restricted unpickler) before DCP sees the folder
        except (RemoteError, UnsafeCheckpoint) as e:
            raise CheckpointError(f"checkpoint {self.where(step)}: {e}") from None
        return reader

    def read(self, step: int, slices: dict[str, Slice]) -> None:
        read_slices(self.where(step), slices, reader=self._reader(step))

    def shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        md = self._reader(step).read_metadata()
        return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def prune(self, keep: int) -> list[str]:
        """Keep-N: each older step's marker first (it vanishes at once), then its objects."""
        removed = []
        for step in to_prune(self.steps(), keep):
            with self._errors(self._key(step_dir_name(step), MARKER)):
                self.client.delete_object(Bucket=self.bucket, Key=self._key(step_dir_name(step), MARKER))
            self._delete_prefix(self._key(step_dir_name(step)) + "/")
            removed.append(step_dir_name(step))
        return removed

    def clean(self, attempt: str | None, stale_after: float = STALE_TEMP_S) -> list[str]:
        """Attempt folders no marker names: this run's own at once, other runs' once stale."""
        now, removed = time.time(), []
        for step, listed in sorted(self._listing().items()):
            keep = None
            if listed.marker:
                try:
                    keep = self._committed_attempt(step)[1]
                except (CheckpointError, RemoteError):
                    continue   # an unreadable marker: leave the step to verification, touch nothing
            for other in listed.attempts:
                if other != keep and is_own_or_stale(other, attempt, now - listed.touched[other], stale_after):
                    self._delete_prefix(self._data(step, other) + "/")
                    removed.append(f"{step_dir_name(step)}/{other}")
        return removed

    def _delete_prefix(self, prefix: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        with self._errors(prefix):
            for page in pages:
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                for i in range(0, len(keys), DELETE_BATCH):
                    self.client.delete_objects(Bucket=self.bucket,
                                               Delete={"Objects": keys[i:i + DELETE_BATCH], "Quiet": True})
