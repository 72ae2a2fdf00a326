"""The shared checkpoint tier in an object store, end to end: `shardwise train --checkpoint-uri
s3://...` as real local processes (gloo) against a real S3 server (MinIO on loopback).

A TP=2 run is killed while a checkpoint's data is written but its marker is not, and resumed
from the store alone (a fresh --checkpoint-dir: the node and its disk are gone) by one process:
it must load the newest step that has a marker, resharded, and reproduce the uninterrupted run's
losses (fp32, 1e-3). Keep-N deletes old steps in the bucket; wrong credentials are one line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from shardwise.crds.modelsource import S3Uri
from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training.checkpoint_s3 import S3CheckpointStore

STEPS, EVERY, KEEP = 8, 2, 2
COMMON = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--keep", str(KEEP),
          "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3", "--seed", "7", "--json"]
RTOL = 1e-3
DELAY = "SHARDWISE_CHECKPOINT_COMMIT_DELAY_S"
BUCKET = "checkpoints"


def _s3_args(s3_server, prefix: str) -> list[str]:
    return ["--checkpoint-uri", f"s3://{BUCKET}/{prefix}", "--checkpoint-endpoint", s3_server.endpoint,
            "--checkpoint-region", s3_server.region, "--checkpoint-path-style"]


def _keys(s3_client, prefix: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in listed)


def _assert_same_losses(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=RTOL), f"step {s}: {got[s]} vs {want[s]}"


@pytest.fixture(scope="module")
def s3_env(s3_server, s3_client) -> dict[str, str]:
    s3_client.create_bucket(Bucket=BUCKET)
    return s3_server.env()


@pytest.fixture(scope="module")
def store(s3_config, s3_env):
    return lambda prefix: S3CheckpointStore(S3Uri(BUCKET, prefix), s3_config, env=s3_env)


@pytest.fixture(scope="module")
def reference(work, train, s3_server, s3_env):
    """The uninterrupted run under TP=2, checkpointing to s3://checkpoints/ref."""
    code, recs, err = train.run(work / "ref", *_s3_args(s3_server, "ref"), "--tensor-parallel", "2", env=s3_env)
    assert code == 0, err
    assert sorted(recs) == list(range(1, STEPS + 1))
    return recs


def test_keep_n_deletes_old_steps_in_the_bucket(reference, store, s3_client, work):
    assert store("ref").steps() == [6, 8]                     # keep 2 of 2, 4, 6, 8
    keys = _keys(s3_client, "ref")
    assert not [k for k in keys if k.startswith(("step-00000002", "step-00000004"))]
    assert "step-00000008/COMPLETE" in keys
    marker = json.loads(s3_client.get_object(Bucket=BUCKET, Key="ref/step-00000008/COMPLETE")["Body"].read())
    data = {k.split("/", 2)[2] for k in keys if k.startswith(f"step-00000008/{marker['attempt']}/")}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "config.json"} <= data
    assert set(marker["files"]) == data                        # every file, listed before the marker
    assert not list((work / "ref").glob("step-*"))             # nothing of the tier in --checkpoint-dir


def test_killed_run_resumes_from_the_bucket_in_another_layout(train, reference, store, s3_client, s3_server,
                                                               s3_env, tmp_path):
    """Step 6's data is written and its commit held back when rank 1 is killed: the bucket has
    steps 2 and 4 committed and step 6 without a marker. One process on a fresh disk resumes
    from step 4 (resharded from TP=2), never from the cut-off step 6."""
    proc = train.start(tmp_path / "node-a", *_s3_args(s3_server, "crash"), "--tensor-parallel", "2",
                       env={**s3_env, DELAY: "6:15"})
    deadline = time.time() + 180
    while not [k for k in _keys(s3_client, "crash") if k.startswith("step-00000006/") and k.endswith("/.metadata")]:
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.1)
    os.kill(train.ranks(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    seen = train.records(out)
    _assert_same_losses(seen, reference, seen)
    crash = store("crash")
    assert crash.steps() == [2, 4]                              # step 6 is there, but not visible
    assert "step-00000006/COMPLETE" not in _keys(s3_client, "crash")
    (cut_off,) = {k.split("/")[1] for k in _keys(s3_client, "crash") if k.startswith("step-00000006/")}

    code, got, err = train.run(tmp_path / "node-b", *_s3_args(s3_server, "crash"), env=s3_env)
    assert code == 0, err
    # (the line names the store it read: no claim or local copy could have served it)
    assert f"resumed from checkpoint step 4 (saved under TP=2 PP=1 DP=1, now TP=1 PP=1 DP=1) in s3://{BUCKET}/crash" in err
    assert sorted(got) == list(range(5, STEPS + 1))
    _assert_same_losses(got, reference, got)
    assert crash.steps() == [6, 8]
    marker = json.loads(s3_client.get_object(Bucket=BUCKET, Key="crash/step-00000006/COMPLETE")["Body"].read())
    assert marker["attempt"] != cut_off                         # the new run's own copy of step 6
    # The killed run's folder is another run's: kept while it may be live, removed once stale.
    assert crash.clean(None) == []
    assert crash.clean(None, stale_after=0) == [f"step-00000006/{cut_off}"]
    assert not [k for k in _keys(s3_client, "crash") if f"/{cut_off}/" in k]


def test_a_step_without_its_marker_is_never_loaded(reference, store, s3_client, tmp_path):
    """Copy the reference's step 8 without its marker under another prefix: nothing is visible there."""
    for key in _keys(s3_client, "ref"):
        if key.startswith("step-00000008/") and not key.endswith("/COMPLETE"):
            s3_client.copy_object(Bucket=BUCKET, Key=f"nomarker/{key}", CopySource={"Bucket": BUCKET, "Key": f"ref/{key}"})
    assert _keys(s3_client, "nomarker") and store("nomarker").steps() == []
    assert ckpt.newest_in(store("nomarker")) is None


def test_wrong_credentials_are_one_line(train, s3_server, s3_env, tmp_path):
    env = {**s3_env, "AWS_SECRET_ACCESS_KEY": "not-" + s3_env["AWS_SECRET_ACCESS_KEY"]}
    p = subprocess.run(train.command(tmp_path / "ck", *_s3_args(s3_server, "ref")), capture_output=True,
                       text=True, timeout=120, env={**os.environ, **env})
    assert p.returncode == 2
    assert p.stderr.strip() == (f"shardwise train: --checkpoint-uri: s3://{BUCKET}/ref: access denied "
                                "(SignatureDoesNotMatch); check the credentials in AWS_ACCESS_KEY_ID / "
                                "AWS_SECRET_ACCESS_KEY")
    assert env["AWS_SECRET_ACCESS_KEY"] not in p.stderr


def test_a_malformed_uri_is_one_line(train, tmp_path):
    p = subprocess.run(train.command(tmp_path / "ck", "--checkpoint-uri", "s3://Bad_Bucket/x"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == ("shardwise train: --checkpoint-uri bucket 'Bad_Bucket' is not an S3 bucket name "
                                "(3-63 of a-z, 0-9, '.', '-')")


def test_the_local_tier_in_front_of_the_bucket(train, reference, store, s3_server, s3_env, tmp_path):
    """One process, shared checkpoints to the bucket every 4 steps and local ones every 2: killed
    after local step 6 (bucket: step 4), it resumes from its node's local step 6, newer than the
    bucket's, with the uninterrupted run's losses."""
    local = tmp_path / "local"
    args = [*_s3_args(s3_server, "tiered"), "--checkpoint-every", "4", "--local-checkpoint-dir", str(local),
            "--local-checkpoint-every", "2"]
    proc = train.start(tmp_path / "ck", *args, env={**s3_env, DELAY: "8:60"})
    seen = {}
    for line in proc.stdout:
        rec = json.loads(line)
        seen[rec["step"]] = rec
        if rec["step"] >= 7 and [s for s, _ in ckpt.committed(local / "rank-0")][-1:] == [6]:
            os.kill(train.ranks(proc.pid)[0], signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert store("tiered").steps() == [4]
    code, got, err = train.run(tmp_path / "ck", *args, env=s3_env)
    assert code == 0, err
    assert "resumed from local checkpoint step 6" in err and "newest shared checkpoint: step 4" in err
    assert sorted(got) == [7, 8]
    _assert_same_losses(got, reference, got)
    assert store("tiered").steps() == [4, 8]


def test_a_missing_bucket_is_one_line(train, s3_server, s3_env, tmp_path):
    args = ["--checkpoint-uri", "s3://no-such-bucket/run", "--checkpoint-endpoint", s3_server.endpoint,
            "--checkpoint-path-style"]
    p = subprocess.run(train.command(tmp_path / "ck", *args), capture_output=True, text=True, timeout=120,
                       env={**os.environ, **s3_env})
    assert p.returncode == 2
    assert p.stderr.strip() == "shardwise train: --checkpoint-uri: s3://no-such-bucket/run: not found (NoSuchBucket)"
