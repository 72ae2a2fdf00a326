"""Bad input to `shardwise generate` gives one line naming what is wrong, exit code 2, no traceback.
All of these are caught before any rank starts, so they run in-process and cost no launch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from shardwise.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model):
    return tiny_model(tmp_path_factory.mktemp("tiny"), layers=3, hidden=32, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A model saved by transformers as several safetensors files with an index."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("sharded")
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    return path


def _generate(capsys, model, *extra):
    code = main(["generate", "--model", str(model), "--prompt", "one two", "--max-new-tokens", "2", *extra])
    err = capsys.readouterr().err.strip()
    return code, err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("pipeline", ["1", "2"])
def test_missing_weight_file(capsys, sharded, tmp_path, pipeline):
    """A weight file a stage reads is missing: said before any rank starts, one stage or several
    (a file no stage of this run reads may be absent: a pod's stage fetched alone)."""
    m = _copy(sharded, tmp_path / "m")
    victim = sorted(f for f in os.listdir(m) if f.endswith(".safetensors"))[1]
    os.remove(m / victim)
    code, err = _generate(capsys, m, "--pipeline-parallel", pipeline)
    assert code == 2 and err.count("\n") == 0
    assert victim in err and "missing" in err


def test_truncated_weight_file(capsys, sharded, tmp_path):
    m = _copy(sharded, tmp_path / "m")
    victim = m / sorted(f for f in os.listdir(m) if f.endswith(".safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    code, err = _generate(capsys, m)
    assert code == 2 and "truncated" in err and victim.name in err and "\n" not in err


def test_truncated_gguf(capsys, tmp_path):
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.weights.loader import builtin_model_path
    try:
        src = builtin_model_path("smollm2")
    except WorkerError as e:
        pytest.skip(str(e))
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(8 << 20))
    code, err = _generate(capsys, cut)
    assert code == 2 and "truncated" in err and "\n" not in err


def test_unsupported_architecture(capsys, model, tmp_path):
    m = _copy(model, tmp_path / "m")
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (m / "config.json").write_text(json.dumps(cfg))
    code, err = _generate(capsys, m)
    assert code == 2 and "unsupported architecture 'GPT2LMHeadModel'" in err


def test_tensor_parallel_must_divide_heads_and_lists_the_degrees_that_do(capsys, model):
    code, err = _generate(capsys, model, "--tensor-parallel", "3")
    assert code == 2 and "tensor parallel degree 3" in err and "use one of: 1, 2" in err


def test_more_stages_than_layers(capsys, model):
    code, err = _generate(capsys, model, "--pipeline-parallel", "4")
    assert code == 2 and "4 is more stages than the model's 3 layers" in err


def test_prompt_longer_than_context(capsys, model):
    code = main(["generate", "--model", str(model), "--prompt", "one two three four five six seven eight",
                 "--max-seq-len", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "prompt is" in err and "context holds 4" in err


def test_missing_model_path(capsys, tmp_path):
    code, err = _generate(capsys, tmp_path / "nope")
    assert code == 2 and "not found" in err


def test_cli_prints_one_line_without_traceback(model):
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", str(model), "--prompt", "x",
                        "--tensor-parallel", "3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "use one of: 1, 2" in p.stderr


def test_cuda_graphs_asked_on_cpu(capsys, model):
    """--decode graphs replays CUDA graphs: on CPU it is refused before any rank starts."""
    code, err = _generate(capsys, model, "--decode", "graphs")
    assert code == 2 and "\n" not in err
    assert "--decode graphs needs --device cuda" in err and "eager or compile" in err


def test_compiled_decode_on_cpu_gives_the_eager_tokens(capsys, model):
    """--decode compile on CPU (inductor) continues the prompt as the default eager path does."""
    outs = []
    for extra in ([], ["--decode", "compile"]):
        code = main(["generate", "--model", str(model), "--prompt", "one two", "--max-new-tokens", "4",
                     "--json", *extra])
        assert code == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]
