"""Models fetched from a real S3 server (MinIO on loopback) into the node cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.crds.layout import RankLayout
from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.pull import fetch_stage, hold_stage
from shardwise.worker.fetch.remote import NotFound, Unauthorized
from shardwise.worker.fetch.s3 import S3Config, S3Store
from tests.worker.fetch.conftest import upload_folder

GIB = 1 << 30


def store(s3_server, s3_config, uri="s3://models/tiny", env=None) -> S3Store:
    return S3Store(parse_model_uri(uri), s3_config, s3_server.env() if env is None else env)


def cache(root: Path, budget: int = 10 * GIB, reserve: int = 0) -> ModelCache:
    return ModelCache(CacheConfig(root, budget, disk_reserve_bytes=reserve, backoff_s=(0.1,)))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_fetch_is_byte_identical_and_a_second_fetch_downloads_nothing(s3_server, s3_config, s3_model,
                                                                      sharded_model, tmp_path):
    remote = store(s3_server, s3_config)
    seen = []
    first = fetch_stage(cache(tmp_path), remote, "s3", "models/tiny", progress=lambda d, t: seen.append((d, t)))
    whole = sum(len(b) for b in folder_bytes(sharded_model).values())
    assert folder_bytes(first.files_dir) == folder_bytes(sharded_model)
    assert (first.fetched_bytes, first.reused_bytes) == (whole - first.reused_bytes, first.reused_bytes)
    assert first.fetched_bytes + first.reused_bytes == whole
    assert seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)
    # A restarted pod on the same node (a fresh store object, the same cache root): nothing fetched.
    again = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "models/tiny")
    assert (again.fetched_bytes, again.reused_bytes) == (0, whole)
    assert not list(first.files_dir.rglob(".*part*"))


def test_each_stage_of_a_tp_x_pp_layout_fetches_only_its_share(s3_server, s3_config, s3_model,
                                                               sharded_model, tmp_path):
    layout = RankLayout(tensor=2, pipeline=2)
    weights = {p.name: p.stat().st_size for p in sharded_model.glob("*.safetensors")}
    fetched_by_stage: dict[int, int] = {}
    union: set[str] = set()
    for rank in range(layout.world_size):
        stage = layout.position(rank).stage
        node = tmp_path / f"node-{stage}"      # one pod per stage, its ranks share the node's cache
        report = fetch_stage(cache(node), store(s3_server, s3_config), "s3", "models/tiny",
                             stage=stage, pipeline=layout.pipeline)
        fetched_by_stage[stage] = fetched_by_stage.get(stage, 0) + report.fetched_bytes
        union |= {f for f in report.files if f.endswith(".safetensors")}
        if layout.position(rank).tp_rank:
            assert report.fetched_bytes == 0          # the pod's second rank finds its files cached
    whole = sum(p.stat().st_size for p in sharded_model.iterdir())
    for stage, fetched in fetched_by_stage.items():
        print(f"stage {stage}: fetched {fetched} of {whole} bytes")
        assert 0 < fetched < 0.75 * whole
    assert union == set(weights)


def test_an_object_rewritten_after_listing_is_deleted_and_refused(s3_server, s3_config, s3_client,
                                                                  sharded_model, tmp_path):
    s3_client.create_bucket(Bucket="rewritten")
    upload_folder(s3_client, sharded_model, "rewritten", "m")
    remote = store(s3_server, s3_config, "s3://rewritten/m")
    listing = remote.list_files()            # the ETags (MD5s) of the bytes first uploaded
    victim = next(f for f in listing if f.name.endswith("00002-of-00006.safetensors"))
    original = (sharded_model / victim.name).read_bytes()
    s3_client.put_object(Bucket="rewritten", Key=f"m/{victim.name}", Body=bytes(reversed(original)))
    c = cache(tmp_path)
    with pytest.raises(CacheError) as e:
        with c.open("s3", "rewritten/m", remote.revision()) as entry:
            entry.fill(remote, [victim])
    message = str(e.value)
    assert "checksum does not match" in message and victim.name in message and "\n" not in message
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith((victim.name, f".{victim.name}"))]


def test_wrong_credentials_and_a_missing_bucket_are_one_line_each(s3_server, s3_config, s3_model):
    wrong = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": "not-the-secret-0123"}
    with pytest.raises(Unauthorized) as e:
        store(s3_server, s3_config, env=wrong).list_files()
    assert "access denied" in str(e.value) and "\n" not in str(e.value)
    assert s3_server.secret_key not in str(e.value) and "not-the-secret" not in str(e.value)
    with pytest.raises(NotFound) as e:
        store(s3_server, s3_config, "s3://no-such-bucket/tiny").list_files()
    assert str(e.value).startswith("s3://no-such-bucket/tiny: not found (NoSuchBucket)")
    with pytest.raises(NotFound) as e:
        store(s3_server, s3_config, "s3://models/no-such-prefix").list_files()
    assert str(e.value) == "s3://models/no-such-prefix: no objects under the prefix"


FILL = """
import json, sys, time
from pathlib import Path
from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.cache import CacheConfig, ModelCache
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.s3 import S3Config, S3Store
endpoint, root, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
remote = S3Store(parse_model_uri("s3://models/tiny"), S3Config(endpoint=endpoint, path_style=True))
time.sleep(max(0.0, start - time.time()))     # both processes begin filling at the same moment
report = fetch_stage(ModelCache(CacheConfig(Path(root), 1 << 34, disk_reserve_bytes=0)), remote, "s3", "models/tiny")
print(json.dumps({"fetched": report.fetched_bytes, "reused": report.reused_bytes}))
"""


def test_two_processes_filling_one_entry_download_it_once(s3_server, s3_model, sharded_model, tmp_path):
    env = {**os.environ, **s3_server.env()}
    start = str(time.time() + 8)     # after both have imported their modules
    procs = [subprocess.Popen([sys.executable, "-c", FILL, s3_server.endpoint, str(tmp_path), start], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    whole = sum(p.stat().st_size for p in sharded_model.iterdir())
    assert sum(r["fetched"] for r in results) == whole
    assert all(r["fetched"] + r["reused"] == whole for r in results)


def test_eviction_keeps_the_budget_and_never_removes_an_entry_in_use(s3_server, s3_config, s3_client,
                                                                      sharded_model, tmp_path):
    s3_client.create_bucket(Bucket="evict")
    for copy in ("a", "b", "c"):
        upload_folder(s3_client, sharded_model, "evict", copy)
    whole = sum(p.stat().st_size for p in sharded_model.iterdir())
    c = cache(tmp_path, budget=int(2.5 * whole))     # room for two copies, not three
    remote = {x: store(s3_server, s3_config, f"s3://evict/{x}") for x in "abc"}
    with hold_stage(c, remote["a"], "s3", "evict/a") as (held, _):
        fetch_stage(c, remote["b"], "s3", "evict/b")
        fetch_stage(c, remote["c"], "s3", "evict/c")      # evicts b (a is in use, although older)
        assert held.files_dir.is_dir() and len(list(held.files_dir.iterdir())) == len(list(sharded_model.iterdir()))
        assert sum(size for _, size, _ in c.usage()) <= c.config.budget_bytes
        located = {json.loads((f / "entry.json").read_text())["location"] for f, _, _ in c.usage()}
        assert located == {"evict/a", "evict/c"}
        # With a and c both in use nothing can make room for b: one line, nothing evicted.
        with hold_stage(c, remote["c"], "s3", "evict/c"):
            with pytest.raises(CacheError) as e:
                fetch_stage(c, remote["b"], "s3", "evict/b")
            assert "budget" in str(e.value) and "\n" not in str(e.value)
    # Released, a is the least recently used: it goes now to make room for b (whose metadata the
    # refused fetch had already put in place).
    report = fetch_stage(c, remote["b"], "s3", "evict/b")
    assert report.fetched_bytes > 0.9 * whole and report.fetched_bytes + report.reused_bytes == whole
    assert {json.loads((f / "entry.json").read_text())["location"] for f, _, _ in c.usage()} == {"evict/b", "evict/c"}


def test_a_disk_too_small_is_refused_before_downloading(s3_server, s3_config, s3_model, tmp_path):
    import shutil
    c = cache(tmp_path, reserve=shutil.disk_usage(tmp_path).free)   # no byte to spare
    with pytest.raises(CacheError) as e:
        fetch_stage(c, store(s3_server, s3_config), "s3", "models/tiny")
    assert "free" in str(e.value) and "\n" not in str(e.value)
    assert not any(p.is_file() for p in (tmp_path / "entries").rglob("files/*"))
