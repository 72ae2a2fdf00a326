"""The `oci://` store and the pusher against a real distribution registry (the binary the kind suite
builds) on a loopback port: anonymous, with htpasswd (Basic) auth, and with token (Bearer) auth."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.e2e import localregistry
from shardwise.e2e.localregistry import LocalRegistry
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.oci import OciRemote
from shardwise.worker.fetch.oci_push import EMPTY_CONFIG, push_folder
from shardwise.worker.fetch.registry import MANIFEST_TYPES, Registry
from shardwise.worker.fetch.remote import ChecksumKind, NotFound, RemoteError, Unauthorized
from tests.worker.fetch.conftest import tree_bytes

PASSWORD = "s3cret-registry-password"

pytestmark = pytest.mark.skipif(
    localregistry.binary() is None and not os.environ.get("SHARDWISE_REQUIRE_CLUSTER"),
    reason="the registry binary is not built (shardwise kind build)")


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
    (folder / "tokenizer" / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (folder / "model.safetensors").write_bytes(os.urandom(300_001))
    return folder


@pytest.fixture
def registry(tmp_path):
    with LocalRegistry(tmp_path / "registry") as reg:
        yield reg


def _read(remote, name, start=0, end=None) -> bytes:
    return b"".join(remote.read(name, start, end))


def _push(reg, folder, tag="v1", repo="models/tiny", **auth):
    return push_folder(Registry(reg.host, repo, plain_http=True, **auth), folder, tag)


def test_a_pushed_folder_is_listed_with_sizes_and_verified_digests(registry, model):
    pushed = _push(registry, model)
    remote = OciRemote(registry.host, "models/tiny", "v1", plain_http=True)
    files = {f.name: f for f in remote.list_files()}
    on_disk = {p.relative_to(model).as_posix(): p for p in model.rglob("*") if p.is_file()}
    assert files.keys() == on_disk.keys() and pushed.files == 3
    for name, path in on_disk.items():
        data = path.read_bytes()
        assert files[name].size == len(data)
        assert files[name].checksum.kind is ChecksumKind.SHA256
        assert files[name].checksum.value == hashlib.sha256(data).hexdigest()
        assert _read(remote, name) == data
    assert remote.revision() == pushed.digest
    pinned = OciRemote(registry.host, "models/tiny", pushed.digest, plain_http=True)
    assert pinned.list_files() == remote.list_files()
    assert pinned.describe() == f"oci://{registry.host}/models/tiny@{pushed.digest}"


def test_a_moved_tag_is_a_new_revision_and_unchanged_blobs_are_not_uploaded_again(registry, model):
    first = _push(registry, model)
    again = _push(registry, model)
    assert again.digest == first.digest and again.bytes_uploaded == 0
    old = (model / "config.json").read_bytes()
    (model / "config.json").write_text('{"hidden_size": 128}')
    second = _push(registry, model)
    assert second.digest != first.digest
    assert second.bytes_uploaded == len('{"hidden_size": 128}')     # only the changed file
    assert OciRemote(registry.host, "models/tiny", "v1", plain_http=True).revision() == second.digest
    assert _read(OciRemote(registry.host, "models/tiny", first.digest, plain_http=True), "config.json") == old


def test_a_byte_range_is_that_slice_of_the_blob(registry, model):
    _push(registry, model)
    remote = OciRemote(registry.host, "models/tiny", "v1", plain_http=True)
    data = (model / "model.safetensors").read_bytes()
    for start, end in [(0, 8), (8, 1000), (123_456, 300_001), (299_990, None), (7, 7), (290_000, 10**9)]:
        assert _read(remote, "model.safetensors", start, end) == data[start:end]


def test_a_blob_whose_bytes_do_not_match_its_digest_is_refused(registry, model, tmp_path):
    _push(registry, model)
    remote = OciRemote(registry.host, "models/tiny", "v1", plain_http=True)
    listed = {f.name: f for f in remote.list_files()}["model.safetensors"]
    stored = registry.blob_path("sha256:" + listed.checksum.value)
    stored.write_bytes(b"\0" * listed.size)              # the registry's copy goes bad
    cache = ModelCache(CacheConfig(tmp_path / "cache", 1 << 34, disk_reserve_bytes=0, attempts=1))
    with pytest.raises(CacheError) as e:      # the cache checks the digest over the bytes it wrote
        cache.fetch(remote, "oci", "models/tiny", [listed])
    assert "sha256 checksum does not match" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("model.safetensors"))      # never kept


@pytest.mark.parametrize("repo, reference, words", [
    ("models/tiny", "v2", "no tag or digest 'v2'"),
    ("models/other", "v1", "no tag or digest 'v1'"),
    ("models/tiny", "sha256:" + "0" * 64, "no tag or digest 'sha256:000"),
])
def test_a_missing_tag_or_repository_is_one_line(registry, model, repo, reference, words):
    _push(registry, model)
    with pytest.raises(NotFound) as e:
        OciRemote(registry.host, repo, reference, plain_http=True).list_files()
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bearer", [False, True], ids=["basic", "bearer"])
def test_credentials_are_asked_checked_and_never_shown(tmp_path, model, bearer):
    with LocalRegistry(tmp_path / "registry", users={"alice": PASSWORD}, bearer=bearer) as reg:
        for auth, error in [({}, "anonymous access"), ({"username": "alice", "password": "wrong"},
                                                         "refused the credentials")]:
            with pytest.raises(Unauthorized) as e:
                _push(reg, model, **auth)
            assert error in str(e.value) and "\n" not in str(e.value) and "wrong" not in str(e.value)
        pushed = _push(reg, model, username="alice", password=PASSWORD)
        remote = OciRemote(reg.host, "models/tiny", "v1", plain_http=True, username="alice",
                           password=PASSWORD)
        assert remote.revision() == pushed.digest
        assert _read(remote, "config.json") == (model / "config.json").read_bytes()
        assert PASSWORD not in repr(remote)
        if bearer:
            assert reg.tokens.issued >= 2        # the pull and the push each asked for a token
        with pytest.raises(Unauthorized):
            OciRemote(reg.host, "models/tiny", "v1", plain_http=True).list_files()


def _put_manifest(reg, manifest: dict, tag: str, media=MANIFEST_TYPES[0]) -> None:
    Registry(reg.host, "models/tiny", plain_http=True).put_manifest(
        tag, json.dumps(manifest).encode(), media)


def test_an_artifact_that_is_not_a_model_is_refused_in_one_line(registry, model):
    pushed = _push(registry, model)
    remote = OciRemote(registry.host, "models/tiny", pushed.digest, plain_http=True)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar",
             "digest": "sha256:" + remote.list_files()[0].checksum.value, "size": remote.list_files()[0].size}
    base = {"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0], "config": EMPTY_CONFIG}
    cases = {
        "escape": ({**base, "layers": [{**layer, "annotations": {
            "org.opencontainers.image.title": "../../etc/cron.d/x"}}]}, "'..' path segment"),
        "image": ({**base, "layers": [layer]}, "no org.opencontainers.image.title annotation"),
    }
    for tag, (manifest, words) in cases.items():
        _put_manifest(registry, manifest, tag)
        with pytest.raises(RemoteError) as e:
            OciRemote(registry.host, "models/tiny", tag, plain_http=True).list_files()
        assert words in str(e.value) and "\n" not in str(e.value)
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": MANIFEST_TYPES[0], "digest": pushed.digest, "size": len(
                 Registry(registry.host, "models/tiny", plain_http=True).manifest(pushed.digest)[1])}]}
    _put_manifest(registry, index, "multi", media=index["mediaType"])
    with pytest.raises(RemoteError, match="image index") as e:
        OciRemote(registry.host, "models/tiny", "multi", plain_http=True).list_files()
    assert "\n" not in str(e.value)


def test_a_registry_off_this_machine_is_spoken_to_in_https_unless_the_pod_is_told_otherwise():
    """A pod's store speaks HTTPS to any registry but a loopback one, and plain HTTP to another only
    when its contract says so (the operator's --plain-http-registry list, nothing the spec sets)."""
    from shardwise.crds.contract import SourceContract
    from shardwise.crds.modelsource import parse_model_uri
    from shardwise.worker.fetch.stores import SourceOptions, open_remote, options_of

    def base(uri, options=SourceOptions()):
        return open_remote(parse_model_uri(uri), options, env={})._registry.base

    assert base("oci://registry.example.com:5000/models/tiny:v1").startswith("https://registry.example.com:5000/")
    assert base("oci://127.0.0.1:5000/models/tiny:v1").startswith("http://127.0.0.1:5000/")
    contract = dict(scheme="oci", cache="pod", cache_dir="/cache")
    told = SourceContract(uri="oci://registry.models.svc:5000/m:v1", plain_http=True, **contract)
    untold = SourceContract(uri="oci://registry.models.svc:5000/m:v1", **contract)
    assert base(told.uri, options_of(told)).startswith("http://registry.models.svc:5000/")
    assert base(untold.uri, options_of(untold)).startswith("https://")
    # left out of the file when unset: a worker image older than the field reads the contract
    assert "plain_http" not in untold.model_dump() and told.model_dump()["plain_http"] is True


def _cli(*args, env_extra=None, stdin=""):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "shardwise", "push", *args], capture_output=True,
                          text=True, env=env, input=stdin, timeout=120)


def test_shardwise_push_uploads_a_folder_that_oci_reads_back(tmp_path, model):
    with LocalRegistry(tmp_path / "registry", users={"alice": PASSWORD}) as reg:
        target = f"oci://{reg.host}/models/tiny:v1"
        done = _cli(str(model), target, "--plain-http",
                    env_extra={"OCI_USERNAME": "alice", "OCI_PASSWORD": PASSWORD})
        assert done.returncode == 0, done.stderr
        digest = done.stdout.split("digest: ")[1].split()[0]
        assert f"model.uri: oci://{reg.host}/models/tiny@{digest}" in done.stdout
        remote = OciRemote(reg.host, "models/tiny", digest, plain_http=True, username="alice",
                           password=PASSWORD)
        assert _read(remote, "model.safetensors") == (model / "model.safetensors").read_bytes()
        refused = _cli(str(model), target, "--plain-http", "--username", "alice", "--password-stdin",
                       stdin="wrong-password\n")
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.count("\n") == 1 and "refused the credentials" in refused.stderr
        assert "wrong-password" not in refused.stderr
        bad = _cli(str(model), "docker://x/y")
        assert bad.returncode == 2 and "is not oci://" in bad.stderr
        upper = _cli(str(model), f"oci://{reg.host}/Models/tiny:v1", "--plain-http")
        assert upper.returncode == 2 and "the target repository 'Models/tiny' is not an OCI repository" in upper.stderr


def test_shardwise_fetch_reads_an_oci_model_with_the_pods_credentials(tmp_path, tiny_model):
    """`shardwise fetch oci://...` opens the store the way a pod does (stores.open_remote): a loopback
    registry over HTTP, OCI_USERNAME/OCI_PASSWORD from the environment; a pushed tag defaults to latest."""
    model = tiny_model(tmp_path / "model")
    with LocalRegistry(tmp_path / "registry", users={"alice": PASSWORD}) as reg:
        creds = {"OCI_USERNAME": "alice", "OCI_PASSWORD": PASSWORD}
        pushed = _cli(str(model), f"oci://{reg.host}/models/tiny", "--plain-http", env_extra=creds)
        assert pushed.returncode == 0 and f"to oci://{reg.host}/models/tiny:latest" in pushed.stdout
        fetch = [sys.executable, "-m", "shardwise", "fetch", f"oci://{reg.host}/models/tiny:latest",
                 "--cache", str(tmp_path / "cache"), "--json"]
        done = subprocess.run(fetch, capture_output=True, text=True, timeout=120, env={**os.environ, **creds})
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        whole = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
        assert (report["fetched_bytes"], report["reused_bytes"]) == (whole, 0)
        assert (Path(report["files_dir"]) / "config.json").read_bytes() == (model / "config.json").read_bytes()
        denied = subprocess.run(fetch, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "OCI_USERNAME": "alice", "OCI_PASSWORD": "nope-nope"})
        assert denied.returncode == 1 and denied.stderr.count("\n") == 1 and "nope-nope" not in denied.stderr


def test_an_artifact_fetched_in_parallel_parts_is_byte_identical(registry, model, tmp_path):
    _push(registry, model)
    remote = OciRemote(registry.host, "models/tiny", "v1", plain_http=True)
    cache = ModelCache(CacheConfig(tmp_path / "cache", 1 << 34, disk_reserve_bytes=0, attempts=1,
                                   streams=4, min_part_bytes=64 << 10))    # 300,001 bytes: 4 parts
    report = cache.fetch(remote, "oci", "models/tiny", remote.list_files())
    assert tree_bytes(report.files_dir) == tree_bytes(model)
