"""The commit protocol of the shared tier in an object store, against a real S3 server (MinIO on
loopback), in one process: two writers of one step, a damaged step, keep-N and resharded reads."""
from __future__ import annotations

import warnings

import pytest
import torch

from shardwise.crds.modelsource import S3Uri
from shardwise.worker.training.checkpoint import Slice, newest_in, write_slices
from shardwise.worker.training.checkpoint_s3 import S3CheckpointStore
from shardwise.worker.training.checkpoint_tiers import CheckpointManager

BUCKET = "protocol"
MODEL = {"hidden_size": 4}


@pytest.fixture(scope="module")
def bucket(s3_client):
    s3_client.create_bucket(Bucket=BUCKET)
    return s3_client


@pytest.fixture
def store(bucket, s3_config, s3_server, request):
    return S3CheckpointStore(S3Uri(BUCKET, request.node.name.replace("_", "-")[:60]), s3_config, env=s3_server.env())


def _full(step: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6) * step


def _write(store, step: int, attempt: str, value: torch.Tensor) -> bool:
    store.begin(step, attempt, True)
    write_slices(store.writer(step, attempt), {"w": Slice.whole(value)}, None)
    meta = {"format": "shardwise-checkpoint/1", "step": step, "model": MODEL}
    return store.commit(step, attempt, meta, {"config.json": b"{}"})


def _manager(store, keep: int = 3) -> CheckpointManager:
    return CheckpointManager(store, rank=0, group=None, model_meta=MODEL, keep=keep, asynchronous=False)


def test_the_first_commit_of_a_step_wins_and_the_later_copy_is_dropped(store, bucket):
    assert _write(store, 5, "aaaaaaaaaaaa", _full(1)) is True
    assert _write(store, 5, "bbbbbbbbbbbb", _full(2)) is False
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix=store.uri.prefix + "/")["Contents"]]
    assert not [k for k in keys if "/bbbbbbbbbbbb/" in k]        # the later writer's copy is gone
    got = Slice(torch.zeros(4, 3), (4, 6), (0, 3))
    assert _manager(store).load_latest({"w": got})["step"] == 5
    assert torch.equal(got.tensor, _full(1)[:, 3:])               # the first copy, resharded


def test_a_damaged_step_falls_back_to_the_previous_one(store, bucket):
    _write(store, 1, "aaaaaaaaaaaa", _full(1))
    _write(store, 2, "aaaaaaaaaaaa", _full(2))
    key = f"{store.uri.prefix}/step-00000002/aaaaaaaaaaaa/__0_0.distcp"
    bucket.put_object(Bucket=BUCKET, Key=key, Body=b"truncated")
    got = Slice.whole(torch.zeros(4, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _manager(store).load_latest({"w": got})["step"] == 1
    assert torch.equal(got.tensor, _full(1))
    assert any("__0_0.distcp has 9 bytes" in str(w.message) for w in caught)
    assert newest_in(store)[0] == 1


def test_keep_n_deletes_the_marker_and_objects_of_older_steps(store, bucket):
    manager = _manager(store, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, {"w": Slice.whole(_full(step))}, {})
    assert store.steps() == [3, 4]
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix=store.uri.prefix + "/")["Contents"]]
    assert sorted({k.split("/")[1] for k in keys}) == ["step-00000003", "step-00000004"]


def test_a_pod_reads_the_checkpoint_stores_credentials_under_their_own_prefix(bucket, s3_server, monkeypatch):
    """In a pod the model may come from another S3 store with other credentials: the checkpoint
    store signs with CHECKPOINT_AWS_*, never the pod's AWS_* (and `shardwise train` uses AWS_*)."""
    from shardwise.worker.fetch.s3 import S3Config
    from shardwise.worker.weights.checkpoint_format import CheckpointError
    from shardwise.worker.training.options import TrainOptions, shared_store
    right = s3_server.env()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv("CHECKPOINT_" + key, right[key])
        monkeypatch.setenv(key, "wrong-" + key.lower())
    config = S3Config(endpoint=s3_server.endpoint, region=s3_server.region, path_style=True)
    pod = TrainOptions(model="m", data="d", checkpoint_dir="/unused", steps=1, checkpoint_uri=f"s3://{BUCKET}/pod", checkpoint_s3=config,
                       checkpoint_env_prefix="CHECKPOINT_")
    assert newest_in(shared_store(pod)) is None          # signed with the right keys: an empty prefix
    cli = TrainOptions(model="m", data="d", checkpoint_dir="/unused", steps=1, checkpoint_uri=f"s3://{BUCKET}/pod", checkpoint_s3=config)
    with pytest.raises(CheckpointError) as e:                 # signed with the pod's AWS_*: refused
        newest_in(shared_store(cli))
    assert "access denied" in str(e.value) and "wrong-" not in str(e.value) and "\n" not in str(e.value)
