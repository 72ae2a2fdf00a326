"""Objects uploaded to a real S3 server (MinIO on loopback) in several parts: their ETag ('<hex>-N',
the md5 of the parts' md5s) is verified over the downloaded file in the part sizes the store answers,
and a file whose bytes do not match it is refused."""
from __future__ import annotations

import io
import os

import pytest
from boto3.s3.transfer import TransferConfig

from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.checksums import multipart_etag
from shardwise.worker.fetch.remote import ChecksumKind
from shardwise.worker.fetch.s3 import S3Store

MIB = 1 << 20
SIZE = 11 * MIB + 4321          # three parts of 5 MiB (MinIO's smallest), the last one short


def upload(client, key: str, body: bytes) -> None:
    client.upload_fileobj(io.BytesIO(body), "multipart", key,
                          Config=TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB))


def upload_parts(client, key: str, body: bytes, sizes: list[int]) -> None:
    """One multipart upload with parts of exactly these sizes (not all equal)."""
    up = client.create_multipart_upload(Bucket="multipart", Key=key)
    done, at = [], 0
    for n, size in enumerate(sizes, 1):
        part = client.upload_part(Bucket="multipart", Key=key, UploadId=up["UploadId"], PartNumber=n,
                                  Body=body[at:at + size])
        done.append({"ETag": part["ETag"], "PartNumber": n})
        at += size
    client.complete_multipart_upload(Bucket="multipart", Key=key, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": done})


@pytest.fixture(scope="module")
def bucket(s3_client) -> dict[str, bytes]:
    s3_client.create_bucket(Bucket="multipart")
    bodies = {"m/model.safetensors": os.urandom(SIZE), "uneven/model.safetensors": os.urandom(SIZE)}
    upload(s3_client, "m/model.safetensors", bodies["m/model.safetensors"])
    upload_parts(s3_client, "uneven/model.safetensors", bodies["uneven/model.safetensors"],
                 [5 * MIB, 6 * MIB, SIZE - 11 * MIB])
    return bodies


def cache(root) -> ModelCache:
    return ModelCache(CacheConfig(root, 1 << 34, disk_reserve_bytes=0, streams=4, min_part_bytes=2 * MIB))


@pytest.mark.parametrize("prefix", ["m", "uneven"])
def test_a_multipart_object_is_verified_by_its_etag(s3_server, s3_config, bucket, tmp_path, prefix):
    remote = S3Store(parse_model_uri(f"s3://multipart/{prefix}"), s3_config, s3_server.env())
    [f] = remote.list_files()
    assert f.checksum.kind is ChecksumKind.S3_MULTIPART_MD5 and f.checksum.value.endswith("-3")
    report = cache(tmp_path).fetch(remote, "s3", f"multipart/{prefix}", [f])
    got = report.files_dir / f.name
    assert got.read_bytes() == bucket[f"{prefix}/{f.name}"]
    # what the cache compared: the ETag recomputed in the store's part sizes (uneven ones asked one
    # by one once equal ones guessed from the first do not match)
    assert multipart_etag(got, remote.part_sizes(f.name, f.size, 3, exact=True)) == f.checksum.value


def test_a_multipart_object_whose_bytes_do_not_match_its_etag_is_refused(s3_server, s3_config, s3_client,
                                                                         bucket, tmp_path):
    remote = S3Store(parse_model_uri("s3://multipart/m"), s3_config, s3_server.env())
    [f] = remote.list_files()          # the ETag of the bytes first uploaded
    original = bucket["m/model.safetensors"]
    corrupt = original[:7 * MIB] + bytes([original[7 * MIB] ^ 1]) + original[7 * MIB + 1:]
    upload(s3_client, "m/model.safetensors", corrupt)      # one bit flipped, same size, same parts
    try:
        with pytest.raises(CacheError) as e:
            cache(tmp_path).fetch(remote, "s3", "multipart/m", [f])
    finally:
        upload(s3_client, "m/model.safetensors", original)
    message = str(e.value)
    assert "s3-multipart-md5 checksum does not match" in message and "deleted, not loaded" in message
    assert "\n" not in message
    assert not [p for p in tmp_path.rglob("*") if "model.safetensors" in p.name]
