"""A GGUF model's pipeline stages fetched by byte ranges from a real S3 server (MinIO on loopback):
each stage fetches about its share of the file into a partial file of the node cache, loads through
the worker's GGUF loader exactly the tensors the whole file holds, and a later stage on the node
fetches only what is missing, after which the file is whole and verified."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shardwise.crds.gguf import read_header
from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch import present
from shardwise.worker.fetch.cache import CacheConfig, CacheError, ModelCache
from shardwise.worker.fetch.gguf_fill import HEADER_FIRST_BYTES
from shardwise.worker.fetch.pull import fetch_stage
from shardwise.worker.fetch.remote import RemoteError
from shardwise.worker.fetch.s3 import S3Store
from shardwise.worker.fetch.select import StageShare, gguf_share, gguf_stage_ranges
from shardwise.worker.weights.gguf_index import write_requantized
from shardwise.worker.weights.loader import load_stage, open_model

LAYERS, HIDDEN, FFN, VOCAB = 6, 128, 256, 512
GIB = 1 << 30


def write_tiny_gguf(folder: Path) -> Path:
    """A random 6-layer Llama GGUF, its matrices in Q8_0 (laid out by the project's writer)."""
    from gguf import GGUFWriter
    rng = np.random.default_rng(0)
    src, dst = folder / "f32.gguf", folder / "model.gguf"
    w = GGUFWriter(str(src), "llama")
    for add, value in ((w.add_block_count, LAYERS), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_vocab_size, VOCAB), (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 1e4)):
        add(value)
    w.add_token_list([f"t{i}".encode() for i in range(VOCAB)])

    def t(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.05)

    t("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        t(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        t(f"blk.{i}.attn_k.weight", HIDDEN // 2, HIDDEN)
        t(f"blk.{i}.attn_v.weight", HIDDEN // 2, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        t(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    t("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_requantized(str(src), str(dst), "Q8_0")
    src.unlink()
    return dst


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, s3_server, s3_client) -> Path:
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf"))
    s3_client.create_bucket(Bucket="ggufs")
    s3_client.put_object(Bucket="ggufs", Key="tiny/model.gguf", Body=path.read_bytes())
    return path


def store(s3_server, s3_config, uri="s3://ggufs/tiny") -> S3Store:
    return S3Store(parse_model_uri(uri), s3_config, s3_server.env())


def cache(root: Path) -> ModelCache:
    return ModelCache(CacheConfig(root, 10 * GIB, disk_reserve_bytes=0, backoff_s=(0.1,), min_part_bytes=1 << 20))


def stage_tensors(path: Path, stage: int, pipeline: int = 2) -> dict:
    """The stage's parameters as the worker's GGUF loader reads them from `path`."""
    share = gguf_share(path, stage, pipeline)
    model = load_stage(open_model(str(path)), *share.layers, share.first, share.last)
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] == b[k]).all(), k


def share_bytes(path: Path, stage: int) -> int:
    header, size = read_header(path), path.stat().st_size
    return present.total(gguf_stage_ranges(header, size, gguf_share(path, stage, 2)))


def test_each_stage_fetches_its_share_and_loads_the_whole_files_tensors(s3_server, s3_config, gguf_model, tmp_path):
    size = gguf_model.stat().st_size
    for stage in (0, 1):
        node = tmp_path / f"node-{stage}"        # one pod per stage, each on its own node
        seen = []
        report = fetch_stage(cache(node), store(s3_server, s3_config), "s3", "ggufs/tiny", stage, 2,
                             progress=lambda d, t: seen.append((d, t)))
        print(f"stage {stage}: fetched {report.fetched_bytes} of {size} bytes")
        # its share: the header and its tensors (plus at most the first header read's 256 KiB)
        assert share_bytes(gguf_model, stage) <= report.fetched_bytes <= share_bytes(gguf_model, stage) + HEADER_FIRST_BYTES
        assert report.fetched_bytes < 0.7 * size and report.reused_bytes == 0
        assert seen[-1] == (report.fetched_bytes, report.fetched_bytes) and all(d <= t for d, t in seen)
        assert seen[0] == (0, report.fetched_bytes)      # nothing was cached: every byte is to fetch
        # the node's cache counts the bytes present, not the sparse file's size
        [(_, held, _)] = cache(node).usage()
        assert held == report.fetched_bytes
        loaded = report.files_dir / "model.gguf"
        assert loaded.stat().st_size == size
        assert_same_tensors(stage_tensors(loaded, stage), stage_tensors(gguf_model, stage))
        # A restarted pod of the stage fetches nothing.
        again = fetch_stage(cache(node), store(s3_server, s3_config), "s3", "ggufs/tiny", stage, 2)
        assert (again.fetched_bytes, again.reused_bytes) == (0, report.fetched_bytes)


def test_a_second_stage_on_the_node_fetches_only_what_is_missing_and_completes_the_file(
        s3_server, s3_config, gguf_model, tmp_path):
    size = gguf_model.stat().st_size
    first = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 0, 2)
    second = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 1, 2)
    assert first.fetched_bytes + second.fetched_bytes == size          # every byte fetched once
    assert second.reused_bytes > 0                                      # the header at least
    # every range in: the whole file, verified by the store's MD5, no longer partial
    assert (first.files_dir / "model.gguf").read_bytes() == gguf_model.read_bytes()
    assert not list((tmp_path / "entries").glob("*/.ranges/*"))
    # A stage of one (TP=1 PP=1) now finds the whole file.
    whole = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny")
    assert (whole.fetched_bytes, whole.reused_bytes) == (0, size)
    # and a stage's pod finds its ranges in the whole file
    again = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 0, 2)
    assert (again.fetched_bytes, again.reused_bytes) == (0, first.fetched_bytes)


def test_a_replanned_stage_fetches_only_its_new_layers(s3_server, s3_config, gguf_model, tmp_path):
    fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 1, 2, layers=(3, 6))
    wider = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 1, 2, layers=(2, 6))
    layer = next(t for t in read_header(gguf_model).tensors if t.name == "blk.2.attn_norm.weight")
    after = next(t for t in read_header(gguf_model).tensors if t.name == "blk.3.attn_norm.weight")
    assert wider.fetched_bytes == after.offset - layer.offset          # layer 2's bytes, nothing else


def test_two_stages_filling_one_node_at_once_both_succeed(s3_server, s3_config, gguf_model, tmp_path):
    env = {**os.environ, **s3_server.env()}
    runs = [subprocess.Popen([sys.executable, "-m", "shardwise", "fetch", "s3://ggufs/tiny", "--cache",
                              str(tmp_path), "--endpoint", s3_server.endpoint, "--path-style", "--stage",
                              str(stage), "--pipeline", "2", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for stage in (0, 1)]
    outs = [r.communicate(timeout=60) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [e for _, e in outs]
    reports = [json.loads(o) for o, _ in outs]
    assert sum(r["fetched_bytes"] for r in reports) == gguf_model.stat().st_size
    files = Path(reports[0]["files_dir"]) / "model.gguf"
    assert files.read_bytes() == gguf_model.read_bytes()
    for stage in (0, 1):
        assert_same_tensors(stage_tensors(files, stage), stage_tensors(gguf_model, stage))


def test_a_corrupted_range_is_refused_and_deleted_when_the_file_completes(s3_server, s3_config, gguf_model, tmp_path):
    first = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 0, 2)
    path = first.files_dir / "model.gguf"
    at = next(t for t in read_header(path).tensors if t.name == "blk.0.ffn_up.weight").offset
    with open(path, "r+b") as f:              # a bit flipped in stage 0's tensors on the node's disk
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CacheError) as e:
        fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 1, 2)
    assert "checksum does not match" in str(e.value) and "deleted, not loaded" in str(e.value)
    assert "\n" not in str(e.value) and not path.exists()
    assert not list((tmp_path / "entries").glob("*/.ranges/*"))
    # fetched again from the store, the stage loads the store's bytes
    again = fetch_stage(cache(tmp_path), store(s3_server, s3_config), "s3", "ggufs/tiny", 1, 2)
    assert_same_tensors(stage_tensors(again.files_dir / "model.gguf", 1), stage_tensors(gguf_model, 1))


class _LyingStore(S3Store):
    def __init__(self, *args, extra: int):
        super().__init__(*args)
        self.extra = extra

    def list_files(self):
        return [replace(f, size=f.size + self.extra) for f in super().list_files()]


@pytest.mark.parametrize("extra,says", [(4096, "the store lists"), (-4096, "past the end of the file")])
def test_a_store_that_lies_about_the_size_is_refused(s3_server, s3_config, gguf_model, tmp_path, extra, says):
    lying = _LyingStore(parse_model_uri("s3://ggufs/tiny"), s3_config, s3_server.env(), extra=extra)
    with pytest.raises(CacheError) as e:
        fetch_stage(cache(tmp_path), lying, "s3", "ggufs/tiny", 0, 2)
    assert says in str(e.value) and "refused" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "entries").glob("*/files/*.gguf"))


def test_a_header_that_does_not_parse_is_refused(s3_server, s3_config, s3_client, gguf_model, tmp_path):
    bad = bytearray(gguf_model.read_bytes())
    bad[4:8] = (99).to_bytes(4, "little")            # a version no reader knows
    s3_client.put_object(Bucket="ggufs", Key="bad/model.gguf", Body=bytes(bad))
    with pytest.raises(CacheError) as e:
        fetch_stage(cache(tmp_path), store(s3_server, s3_config, "s3://ggufs/bad"), "s3", "ggufs/bad", 1, 2)
    assert "GGUF version 99 is not supported" in str(e.value) and "\n" not in str(e.value)


def test_gguf_share_follows_the_plans_split_and_the_tied_head(gguf_model):
    assert gguf_share(gguf_model, 1, 2) == StageShare(1, 2, gguf_share(gguf_model, 1, 2).layers, False)
    assert gguf_share(gguf_model, 1, 2, (4, 6)).layers == (4, 6)


def test_a_stage_pods_log_line_counts_its_ranges(s3_server, gguf_model, tmp_path, monkeypatch, capsys):
    from shardwise.crds.contract import ModelContract, PodContract, ServingContract, SourceContract
    from shardwise.crds.plan import ShardPlan, StagePlacement
    from shardwise.worker.cli.pod_fetch import fetch_model
    from shardwise.worker.serving.rank import free_port
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    placements = [StagePlacement(replica=0, stage=s, node=f"n{s}", gpus=1, layer_start=3 * s, layer_end=3 * s + 3,
                                 embedding=s == 0, head=s == 1) for s in (0, 1)]
    contract = PodContract(
        plan=ShardPlan(tensor=1, pipeline=2, replicas=1, num_layers=LAYERS, placements=placements),
        model=ModelContract(path="s3://ggufs/tiny", format="auto", dtype="auto"), workload="inference",
        serving=ServingContract(port=free_port(), model_name="tiny"), termination_log=str(tmp_path / "log"),
        source=SourceContract(uri="s3://ggufs/tiny", scheme="s3", endpoint=s3_server.endpoint, path_style=True,
                              cache="node", cache_dir=str(tmp_path / "cache"), cache_budget=1 << 30))
    folder, _ = fetch_model(contract, placements[1], "127.0.0.1")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    header, size = read_header(gguf_model), gguf_model.stat().st_size
    ranges = gguf_stage_ranges(header, size, gguf_share(gguf_model, 1, 2, (3, 6)))
    mib = present.total([*ranges, (0, HEADER_FIRST_BYTES)]) / (1 << 20)   # with the first header read
    assert f"fetched {mib:.1f} MiB, reused 0.0 MiB from the node's cache (1 file of stage 1)" in line, line
    assert mib < 0.7 * gguf_model.stat().st_size / (1 << 20)
    assert_same_tensors(stage_tensors(Path(folder) / "model.gguf", 1), stage_tensors(gguf_model, 1))


def test_the_fetch_command_takes_the_plans_layers(s3_server, gguf_model, tmp_path):
    def fetch(*extra):
        return subprocess.run([sys.executable, "-m", "shardwise", "fetch", "s3://ggufs/tiny", "--cache", str(tmp_path),
                               "--endpoint", s3_server.endpoint, "--path-style", "--stage", "1", "--pipeline", "2",
                               "--json", *extra], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **s3_server.env()})
    done = fetch("--layers", "5:6")
    assert done.returncode == 0, done.stderr
    header, size = read_header(gguf_model), gguf_model.stat().st_size
    ranges = gguf_stage_ranges(header, size, StageShare(1, 2, (5, 6)))
    assert json.loads(done.stdout)["fetched_bytes"] == present.total([*ranges, (0, HEADER_FIRST_BYTES)])
    bad = fetch("--layers", "6:5")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "shardwise fetch: error: --layers must be FIRST:END with FIRST < END (such as 0:40), not '6:5'"]


class _FailingLastPart(S3Store):
    """The real store, but the read of the part ending at byte `last_end` fails after `delay_s` (the
    other parts of the fill are in by then): a stage's fill cut short mid-way."""

    def __init__(self, *args, last_end: int, delay_s: float = 2.0):
        super().__init__(*args)
        self.last_end, self.delay_s = last_end, delay_s

    def read(self, name, start=0, end=None):
        if end == self.last_end:
            time.sleep(self.delay_s)
            raise RemoteError(f"{name}: connection reset (the part ending at {end})")
        return super().read(name, start, end)


def test_a_stage_fill_cut_short_keeps_the_parts_that_landed(s3_server, s3_config, gguf_model, tmp_path):
    share = gguf_stage_ranges(read_header(gguf_model), gguf_model.stat().st_size, gguf_share(gguf_model, 0, 2))
    last_end = max(e for _, e in share)
    config = CacheConfig(tmp_path, 10 * GIB, disk_reserve_bytes=0, attempts=1, streams=4, min_part_bytes=64 << 10)
    failing = _FailingLastPart(parse_model_uri("s3://ggufs/tiny"), s3_config, s3_server.env(), last_end=last_end)
    with pytest.raises(CacheError):
        fetch_stage(ModelCache(config), failing, "s3", "ggufs/tiny", 0, 2)
    # every part but the failed one is recorded (before, only the header was, until all were in)
    [record] = (tmp_path / "entries").glob("*/.ranges/*")
    have = present.read_record(record, gguf_model.stat().st_size, json.loads(record.read_text())["checksum"])
    lost = present.subtract(present.merge(share + [(0, HEADER_FIRST_BYTES)]), have)
    assert len(lost) == 1 and lost[0][1] == last_end, (lost, have)
    assert present.total(lost) <= (last_end - HEADER_FIRST_BYTES) // 3      # one of 4 parts
    again = fetch_stage(ModelCache(config), store(s3_server, s3_config), "s3", "ggufs/tiny", 0, 2)
    assert again.fetched_bytes == present.total(lost)          # only the part that did not land
    assert_same_tensors(stage_tensors(again.files_dir / "model.gguf", 0), stage_tensors(gguf_model, 0))
