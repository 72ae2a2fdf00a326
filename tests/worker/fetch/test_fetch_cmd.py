"""`shardwise fetch` against a real S3 server, and a store that accepts connections but never answers."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardwise.crds.modelsource import parse_model_uri
from shardwise.worker.fetch.remote import RemoteError
from shardwise.worker.fetch.s3 import S3Config, S3Store


def shardwise(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "shardwise", "fetch", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_fetch_command_shows_progress_and_a_second_run_reuses_everything(s3_server, s3_model, sharded_model, tmp_path):
    args = ["s3://models/tiny", "--cache", str(tmp_path), "--endpoint", s3_server.endpoint, "--path-style"]
    first = shardwise(*args, "--json", env=s3_server.env())
    assert first.returncode == 0, first.stderr
    whole = sum(p.stat().st_size for p in sharded_model.iterdir())
    report = json.loads(first.stdout)
    assert (report["fetched_bytes"], report["reused_bytes"]) == (whole, 0)
    assert "(100%)" in first.stderr
    second = shardwise(*args, env=s3_server.env())
    assert second.returncode == 0 and "fetched 0.0 MiB" in second.stdout, second.stderr
    stage = json.loads(shardwise(*args, "--json", "--stage", "1", "--pipeline", "2", env=s3_server.env()).stdout)
    assert stage["fetched_bytes"] == 0 and stage["reused_bytes"] < whole


def test_fetch_command_errors_are_one_line_without_the_secret(s3_server, s3_model, tmp_path):
    wrong = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": "wrong-secret-value"}
    out = shardwise("s3://models/tiny", "--cache", str(tmp_path), "--endpoint", s3_server.endpoint,
                    "--path-style", env=wrong)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("shardwise fetch: error: s3://models/tiny: access denied")
    assert "wrong-secret-value" not in out.stderr + out.stdout
    out = shardwise("s3://models/tiny", "--cache", str(tmp_path), "--streams", "0", env=s3_server.env())
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "--streams between 1 and 32" in out.stderr


def test_a_store_that_never_answers_times_out_in_one_line():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    stop = threading.Event()

    def accept():   # takes the connections and says nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass
    threading.Thread(target=accept, daemon=True).start()
    try:
        config = S3Config(endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}", path_style=True,
                          read_timeout_s=1, attempts=1)
        start = time.monotonic()
        with pytest.raises(RemoteError) as e:
            S3Store(parse_model_uri("s3://models/tiny"), config, {}).list_files()
        assert time.monotonic() - start < 10
        assert str(e.value) == "s3://models/tiny: timed out waiting for the store"
    finally:
        stop.set()
        for c in held:
            c.close()
        listener.close()


def test_fetch_command_takes_the_plans_layer_split_of_a_stage(s3_server, s3_model, sharded_model, tmp_path):
    # a pre-pull pod passes the plan's layers: a stage of one layer fetches fewer files than the even split
    args = ["s3://models/tiny", "--endpoint", s3_server.endpoint, "--path-style", "--json", "--stage", "0",
            "--pipeline", "2"]
    even = json.loads(shardwise(*args, "--cache", str(tmp_path / "a"), env=s3_server.env()).stdout)
    one = json.loads(shardwise(*args, "--cache", str(tmp_path / "b"), "--layers", "0:1", env=s3_server.env()).stdout)
    assert one["files"] == even["files"] - 1 and one["fetched_bytes"] < even["fetched_bytes"]
    out = shardwise(*args, "--cache", str(tmp_path / "c"), "--layers", "3:1", env=s3_server.env())
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "--layers must be FIRST:END" in out.stderr
