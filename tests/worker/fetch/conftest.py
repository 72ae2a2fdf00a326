"""A real S3 server (MinIO, shardwise.e2e.s3server) for the fetch tests, and a tiny model stored in
it as a sharded safetensors folder.

Fixtures
  s3_server (session)   MinIO on a loopback port, a temporary data folder, random credentials;
                        skipped when the binary is not built (`shardwise dev build-s3`)
                        unless SHARDWISE_REQUIRE_CLUSTER is set
  s3_client (session)   a boto3 client signed with the server's credentials (uploads, rewrites)
  sharded_model (session)  a 4-layer tiny model split into one safetensors file per layer, one for
                        the embedding and one for the norm and head, with its index (and an empty
                        added_tokens.json)
  s3_model (session)    (bucket, prefix) holding sharded_model's files, uploaded with s3_client
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardwise.e2e import s3server
from shardwise.worker.fetch.s3 import S3Config, make_client


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    if not os.access(s3server.minio_path(), os.X_OK) and not os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
        pytest.skip("the S3 server is not built: shardwise dev build-s3")
    with s3server.running_s3_server(tmp_path_factory.mktemp("minio")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_config(s3_server) -> S3Config:
    return S3Config(endpoint=s3_server.endpoint, region=s3_server.region, path_style=True,
                    read_timeout_s=10, attempts=2)


@pytest.fixture(scope="session")
def s3_client(s3_server, s3_config):
    client = make_client(s3_config, s3_server.env())
    # boto3 sends an empty PUT with "Expect: 100-continue"; MinIO answers without a 100, and the
    # pooled connection's next request then waits about 30 s. An empty body has nothing to hold back.
    def no_expect_for_empty(request, **_):
        if request.headers.get("Content-Length") in ("0", b"0"):
            request.headers.pop("Expect", None)
    client.meta.events.register("before-send.s3.PutObject", no_expect_for_empty)
    return client


def shard_by_layer(folder: Path) -> Path:
    """Rewrite a tiny model's model.safetensors as one file per layer plus the embedding's and the
    norm and head's, with the index the Hub's sharded models carry."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        if name.startswith("model.layers."):
            key = "layer%02d" % int(name.split(".")[2])
        else:
            key = "embed" if "embed_tokens" in name else "head"
        groups.setdefault(key, {})[name] = t
    names = sorted(groups)
    weight_map = {}
    for i, key in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file(groups[key], str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in groups[key]})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="session")
def sharded_model(tmp_path_factory, tiny_model) -> Path:
    folder = shard_by_layer(tiny_model(tmp_path_factory.mktemp("sharded") / "tiny", layers=4, hidden=64))
    (folder / "added_tokens.json").write_text("")    # an empty object: fetched without a range read
    return folder


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> None:
    """Each file as one single-part object (its ETag is its MD5, which the cache verifies)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(folder).as_posix()}",
                              Body=path.read_bytes())


@pytest.fixture(scope="session")
def s3_model(s3_client, sharded_model) -> tuple[str, str]:
    s3_client.create_bucket(Bucket="models")
    upload_folder(s3_client, sharded_model, "models", "tiny")
    return "models", "tiny"
