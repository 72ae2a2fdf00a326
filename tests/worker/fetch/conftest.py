"""A real S3 server (MinIO, shardwise.e2e.s3server) for the fetch tests, and a tiny model stored in
it as a sharded safetensors folder.

Fixtures (the server itself, s3_server, s3_config and s3_client: tests/worker/conftest.py)
  sharded_model (session)  a 4-layer tiny model split into one safetensors file per layer, one for
                        the embedding and one for the norm and head, with its index (and an empty
                        added_tokens.json)
  s3_model (session)    (bucket, prefix) holding sharded_model's files, uploaded with s3_client
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


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


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its relative path: two trees compare equal byte for byte."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


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
