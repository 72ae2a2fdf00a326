"""The `hf://` store read through the official huggingface_hub client against a local endpoint that
answers the Hub's API (shardwise.e2e.hubserver), with HF_ENDPOINT and HF_TOKEN as a pod gets them."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from shardwise.e2e.hubserver import HubServer
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.hub import HubRemote
from shardwise.worker.fetch.remote import ChecksumKind, NotFound, RemoteError, Unauthorized
from tests.worker.fetch.conftest import tree_bytes

TOKEN = "hf_test_secret_token_value"


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
    (folder / "tokenizer" / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300_001))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(70_000))
    (folder / "model.Q4_K_M.gguf").write_bytes(os.urandom(50_000))
    return folder


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def listed_sha256(remote, name) -> str:
    return {f.name: f for f in remote.list_files()}[name].checksum.value


def _read(remote, name, start=0, end=None) -> bytes:
    return b"".join(remote.read(name, start, end))


def test_lists_every_file_with_size_and_the_lfs_sha256(hub, model, monkeypatch):
    hub.publish("org/tiny", model)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)       # as the pod gets it
    files = {f.name: f for f in HubRemote("org/tiny").list_files()}
    on_disk = {p.relative_to(model).as_posix(): p for p in model.rglob("*") if p.is_file()}
    assert files.keys() == on_disk.keys()
    for name, path in on_disk.items():
        assert files[name].size == path.stat().st_size
    weights = files["model-00001-of-00002.safetensors"].checksum
    assert weights.kind is ChecksumKind.SHA256
    assert weights.value == hashlib.sha256(on_disk["model-00001-of-00002.safetensors"].read_bytes()).hexdigest()
    assert files["config.json"].checksum.kind is ChecksumKind.GIT_BLOB_SHA1


def test_a_branch_is_pinned_to_its_commit_and_a_moved_branch_is_a_new_revision(hub, model):
    first = hub.publish("org/tiny", model, tags=("v1",))
    remote = HubRemote("org/tiny", "main", endpoint=hub.url)
    assert remote.revision() == first
    old = (model / "config.json").read_bytes()
    (model / "config.json").write_text('{"hidden_size": 128}')
    second = hub.publish("org/tiny", model)
    assert second != first
    assert HubRemote("org/tiny", "main", endpoint=hub.url).revision() == second
    # The store that pinned `first` keeps reading it, as does one asking for the tag or the sha.
    assert _read(remote, "config.json") == old
    assert HubRemote("org/tiny", "v1", endpoint=hub.url).revision() == first
    assert _read(HubRemote("org/tiny", first, endpoint=hub.url), "config.json") == old


def test_a_byte_range_is_that_slice_of_the_file_and_is_asked_as_a_range(hub, model):
    hub.publish("org/tiny", model)
    remote = HubRemote("org/tiny", endpoint=hub.url)
    data = (model / "model-00001-of-00002.safetensors").read_bytes()
    for start, end in [(0, 8), (8, 1000), (123_456, 300_001), (299_990, None), (5, 5), (290_000, 10**9)]:
        assert _read(remote, "model-00001-of-00002.safetensors", start, end) == data[start:end]
    sha = listed_sha256(remote, "model-00001-of-00002.safetensors")
    ranges = [r for _, path, r, _ in hub.requests if path == f"/cdn/{sha}"]
    assert "bytes=8-999" in ranges      # only the slice travelled, from the storage host


def _cached(remote, tmp_path, name):
    """Fetch one listed file into a node cache, as a pod does: the cache checks the bytes it wrote."""
    listed = {f.name: f for f in remote.list_files()}[name]
    cache = ModelCache(CacheConfig(tmp_path / "cache", 1 << 34, disk_reserve_bytes=0, attempts=1))
    return cache.fetch(remote, "hf", remote.repo_id, [listed])


def test_a_whole_file_whose_bytes_do_not_match_the_listed_sha256_is_refused(hub, model, tmp_path):
    hub.publish("org/tiny", model)
    remote = HubRemote("org/tiny", endpoint=hub.url)
    listed = {f.name: f for f in remote.list_files()}["model-00002-of-00002.safetensors"]
    stored = hub.store / listed.checksum.value          # the endpoint's copy goes bad
    stored.write_bytes(b"\0" * listed.size)
    with pytest.raises(CacheError) as e:
        _cached(remote, tmp_path, "model-00002-of-00002.safetensors")
    assert "checksum does not match" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("model-00002-of-00002.safetensors"))   # never kept
    (model / "config.json").write_text("{}")            # a small file: its git blob id is checked
    hub.publish("org/small", model)
    remote = HubRemote("org/small", endpoint=hub.url)
    assert {f.name: f for f in remote.list_files()}["config.json"].checksum.kind is ChecksumKind.GIT_BLOB_SHA1
    blob = [b for b in hub.repos["org/small"].commits[remote.revision()].values() if b.size == 2][0]
    blob.path.write_bytes(b"[]")
    with pytest.raises(CacheError, match="git-blob-sha1 checksum does not match"):
        _cached(remote, tmp_path, "config.json")


def test_a_named_gguf_lists_only_that_file(hub, model):
    hub.publish("org/tiny", model)
    remote = HubRemote("org/tiny", filename="model.Q4_K_M.gguf", endpoint=hub.url)
    assert [f.name for f in remote.list_files()] == ["model.Q4_K_M.gguf"]
    assert remote.describe() == "hf://org/tiny/model.Q4_K_M.gguf"
    assert HubRemote("org/tiny", "v1", "model.Q4_K_M.gguf").describe() == "hf://org/tiny@v1/model.Q4_K_M.gguf"
    with pytest.raises(NotFound, match="no file 'model.Q8_0.gguf'"):
        HubRemote("org/tiny", filename="model.Q8_0.gguf", endpoint=hub.url).list_files()


@pytest.mark.parametrize("repo, revision, token, error, words", [
    ("org/missing", None, TOKEN, NotFound, "no such repository"),
    ("org/tiny", "no-such-branch", TOKEN, NotFound, "no revision 'no-such-branch'"),
    ("org/tiny", None, "hf_wrong", Unauthorized, "refused the token"),
    ("org/tiny", None, None, NotFound, "needs a token: HF_TOKEN"),
])
def test_bad_input_is_one_line_without_the_token(model, repo, revision, token, error, words, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer(token=TOKEN) as hub:
        hub.publish("org/tiny", model)
        with pytest.raises(error) as e:
            HubRemote(repo, revision, endpoint=hub.url, token=token).list_files()
    message = str(e.value)
    assert words in message and "\n" not in message and len(message) < 300
    assert TOKEN not in message and "hf_wrong" not in message


def test_a_gated_repository_is_listed_but_its_files_are_refused_in_one_line(hub, model):
    hub.publish("org/gated", model)
    hub.gated.add("org/gated")
    remote = HubRemote("org/gated", endpoint=hub.url, token=TOKEN)
    assert len(remote.list_files()) == 5
    with pytest.raises(Unauthorized) as e:
        _read(remote, "config.json")
    assert "gated" in str(e.value) and "\n" not in str(e.value) and TOKEN not in str(e.value)


def test_the_token_comes_from_hf_token_and_stays_on_the_hub(model, monkeypatch):
    with HubServer(token=TOKEN) as hub:
        hub.publish("org/tiny", model)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        remote = HubRemote("org/tiny", endpoint=hub.url)
        assert len(remote.list_files()) == 5
        assert _read(remote, "config.json") == (model / "config.json").read_bytes()
        weights = (model / "model.Q4_K_M.gguf").read_bytes()
        assert _read(remote, "model.Q4_K_M.gguf", 100, 200) == weights[100:200]
        assert TOKEN not in repr(remote)
        # The weights came from the storage host the Hub redirected to, which got no token.
        storage = [authorized for _, path, _, authorized in hub.requests if path.startswith("/cdn/")]
        assert storage and not any(storage)


def test_an_endpoint_that_does_not_answer_is_one_line(model):
    with pytest.raises(RemoteError) as e:
        HubRemote("org/tiny", endpoint="http://127.0.0.1:9", timeout_s=2).list_files()
    assert "cannot reach the Hub" in str(e.value) and "\n" not in str(e.value)


def test_a_listing_that_names_a_file_outside_the_model_is_refused(hub, model):
    sha = hub.publish("org/tiny", model)
    files = hub.repos["org/tiny"].commits[sha]
    files["../../etc/cron.d/job"] = files["config.json"]       # what a hostile endpoint could list
    with pytest.raises(RemoteError) as e:
        HubRemote("org/tiny", endpoint=hub.url).list_files()
    assert "'..' path segment" in str(e.value) and "\n" not in str(e.value)


def test_the_local_endpoint_answers_the_clients_own_download(hub, model, tmp_path):
    """The stand-in is faithful where the client checks most: hf_hub_download's HEAD (commit, etag,
    size from a redirect it does not follow) and its download through the storage redirect."""
    from huggingface_hub import hf_hub_download

    commit = hub.publish("org/tiny", model)
    for name in ("config.json", "model-00002-of-00002.safetensors"):
        path = hf_hub_download("org/tiny", name, endpoint=hub.url, cache_dir=tmp_path / "hf", token=False)
        assert Path(path).read_bytes() == (model / name).read_bytes()
        assert f"/snapshots/{commit}/" in Path(path).as_posix()


def test_a_model_fetched_in_parallel_parts_is_byte_identical_and_checked_whole(hub, model, tmp_path):
    hub.publish("org/tiny", model)
    remote = HubRemote("org/tiny", endpoint=hub.url)
    cache = ModelCache(CacheConfig(tmp_path / "cache", 1 << 34, disk_reserve_bytes=0, attempts=1,
                                   streams=4, min_part_bytes=64 << 10))    # 300,001 bytes: 4 parts
    report = cache.fetch(remote, "hf", "org/tiny", remote.list_files())
    assert tree_bytes(report.files_dir) == tree_bytes(model)
    listed = {f.name: f for f in remote.list_files()}["model-00001-of-00002.safetensors"]
    stored = hub.store / listed.checksum.value
    stored.write_bytes(stored.read_bytes()[:-1] + b"\0")       # one byte of the last part goes bad
    again = ModelCache(CacheConfig(tmp_path / "other", 1 << 34, disk_reserve_bytes=0, attempts=1,
                                   streams=4, min_part_bytes=64 << 10))
    with pytest.raises(CacheError, match="sha256 checksum does not match"):
        again.fetch(remote, "hf", "org/tiny", [listed])
    assert not list((tmp_path / "other").rglob("*model-00001-of-00002.safetensors*"))
