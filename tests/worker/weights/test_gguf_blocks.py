"""GGUF blocks kept as stored (`--quantize gguf`, worker/weights/gguf_blocks.py): the re-layout against
the gguf package's own dequantization, what a rank holds against the planner's rule, and quality
on SmolLM2 (its Q4_1 file, and Q8_0 / Q5_0 variants of it) against the dequantized model, through
real TP x PP launches."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.gguf_blocks import BLOCK, Blocks, BlockLinear, int4_planes
from shardwise.worker.serving.rank import LocalRuntime, RankSpec, teacher_forced_nll, validate

from .test_quantize import PROMPTS, TEXT, _small_llama, _smollm2

TYPES = ("Q8_0", "Q4_0", "Q4_1")


def _blocks(qtype: str, rows: int, inputs: int, seed: int = 0) -> tuple[Blocks, np.ndarray]:
    """A random matrix quantized by the gguf package, and its dequantized values (the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, inputs)) * rng.uniform(0.01, 0.2, (rows, 1))).astype(np.float32)
    w[:, :BLOCK] += 0.3                          # a block far from zero: Q4_1's min matters
    raw = quantize(w, GGMLQuantizationType[qtype])
    return Blocks(qtype, raw), dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, inputs)


# ---------------------------------------------------------------- the layout


@pytest.mark.parametrize("qtype", TYPES)
def test_planes_are_exactly_the_files_values(qtype):
    blocks, ref = _blocks(qtype, 37, 96)
    assert blocks.shape == (37, 96)
    v, scale, zero = int4_planes(blocks)
    assert v.min() >= 0 and v.max() <= 15
    rows = v.shape[0]
    w = ((v.reshape(rows, -1, BLOCK).astype(np.float64) - 8) * scale[..., None] + zero[..., None]).reshape(rows, -1)
    if qtype == "Q8_0":                          # the high and the low plane, over the same inputs
        w = w[:, :96] + w[:, 96:]
    assert np.array_equal(w, ref.astype(np.float64))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [48, 37])      # 48: the CPU int4 kernel; 37 rows: the fallback
def test_block_linear_multiplies_like_the_dequantized_matrix(qtype, rows):
    blocks, ref = _blocks(qtype, rows, 128, seed=rows)
    lin = BlockLinear(blocks)
    ref = torch.from_numpy(ref)
    for n in (1, 5):
        x = torch.randn(n, 128)
        want = x @ ref.t()
        got = lin.mm(x)
        assert got.dtype == torch.float32
        # bfloat16 scales and activations: about a bfloat16 model's rounding
        assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    x3 = torch.randn(2, 3, 128)
    assert lin(x3).shape == (2, 3, rows)
    nbytes = sum(p.numel() * p.element_size() for p in lin.parameters())
    from shardwise.crds.modelshape import GGUF_NATIVE_BYTES
    assert nbytes == GGUF_NATIVE_BYTES[qtype] * rows * 128


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [128, 48, 37])  # 128: rows read from the kernel's own packing
def test_rows_read_from_the_blocks_are_the_files_rows(qtype, rows):
    """An embedding kept in blocks (BlockEmbedding) dequantizes only the looked-up rows."""
    from shardwise.worker.weights.gguf_blocks import BlockEmbedding
    blocks, ref = _blocks(qtype, rows, 96, seed=rows)
    table = BlockLinear(blocks, rows=True)
    ids = torch.tensor([[0, rows - 1, 5], [17, 5, rows // 2]])
    got = BlockEmbedding(table, torch.float32)(ids)
    assert got.shape == (2, 3, 96)
    want = torch.from_numpy(ref)[ids]
    # the scales in bfloat16 (the module docstring): about a bfloat16 model's rounding
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    # the same values the head multiplies by (read back through the kernel: in bfloat16)
    assert torch.allclose(got, table.dequantized()[ids], rtol=1e-2, atol=1e-3)
    if rows == 128 and table.kernel:
        assert table.layout is not None and table.row_copy is None    # no second copy of the table


def test_column_slices_keep_whole_blocks():
    blocks, ref = _blocks("Q4_1", 16, 128)
    part = blocks.columns(32, 96)
    v, scale, zero = int4_planes(part)
    w = ((v.reshape(16, -1, BLOCK).astype(np.float64) - 8) * scale[..., None] + zero[..., None]).reshape(16, -1)
    assert np.array_equal(w, ref[:, 32:96].astype(np.float64))
    assert blocks.columns(16, 48) is None        # cuts a block: the loader dequantizes instead


# ---------------------------------------------------------------- SmolLM2


NEW_TOKENS = 16


def _run(model: str, tp: int, pp: int, quantize: str, prompts, text):
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    spec = RankSpec(model, tp, pp, max_batch=2, max_seq=384, quantize=quantize)
    with LocalRuntime(spec) as ctx:
        nll = teacher_forced_nll(ctx, text)
        engine = Engine(ctx.stage, spec.max_batch, ctx.max_seq, [])
        reqs = engine.generate([Request(list(p), max_new_tokens=NEW_TOKENS) for p in prompts])
        return [r.token_ids for r in reqs], math.exp(nll), [r["weight_bytes"] for r in ctx.loaded]


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory):
    """The built-in Q4_1 file, a Q8_0 one made from it, and the dequantized reference of each
    (TP 1, PP 1, float32: the layouts of the dequantized model match transformers elsewhere)."""
    from shardwise.worker.weights.gguf_index import write_requantized
    from shardwise.worker.weights.loader import builtin_model_path
    tok = _smollm2()
    prompts, text = [tok.encode(p) for p in PROMPTS], tok.encode(TEXT)
    q8 = str(tmp_path_factory.mktemp("gguf") / "smollm2-q8_0.gguf")
    write_requantized(builtin_model_path("smollm2"), q8, "Q8_0")
    files = {"Q4_1": builtin_model_path("smollm2"), "Q8_0": q8}
    return prompts, text, files, {k: _run(path, 1, 1, "none", prompts, text) for k, path in files.items()}


@pytest.mark.parametrize("qtype,tp,pp", [("Q4_1", 1, 1), ("Q4_1", 1, 2), ("Q4_1", 3, 1), ("Q4_1", 3, 2),
                                         ("Q8_0", 1, 1), ("Q8_0", 1, 2), ("Q8_0", 3, 1), ("Q8_0", 3, 2)])
def test_smollm2_blocks_match_the_dequantized_model(smollm2_files, qtype, tp, pp):
    prompts, text, files, refs = smollm2_files
    ref_tokens, ref_ppl, ref_bytes = refs[qtype]
    tokens, ppl, q_bytes = _run(files[qtype], tp, pp, "gguf", prompts, text)
    assert tokens == ref_tokens
    assert abs(ppl / ref_ppl - 1) < 0.01, (ppl, ref_ppl)
    print(f"{qtype} tp={tp} pp={pp}: perplexity dequantized {ref_ppl:.4f} blocks {ppl:.4f}; "
          f"bytes {ref_bytes} -> {q_bytes}")
    if (tp, pp) != (1, 1):
        return
    # One rank holds the whole model in the file's blocks, the tied embedding/head (Q8_0 in both
    # files) included: 0.19x of float32 for the Q4_1 file (0.33x with a float32 head), within
    # what the planner sizes a pod by (crds/modelshape.py ModelFacts.quantized, which counts the
    # head in float32).
    from shardwise.crds.modelshape import from_gguf
    facts = from_gguf(files[qtype], "float32")
    assert q_bytes[0] <= round(facts.quantized("gguf").bytes_per_param * facts.params), (q_bytes, facts)
    assert q_bytes[0] < (0.2 if qtype == "Q4_1" else 0.33) * ref_bytes[0], (q_bytes, ref_bytes)


def test_each_rank_keeps_only_its_slice(smollm2_files):
    """Under TP 3 each rank holds a third of the whole (the layer matrices' blocks split by rows or
    by whole blocks of columns; the float32 embedding split by vocabulary rows)."""
    from shardwise.crds.modelshape import from_gguf
    from shardwise.worker.serving.rank import generate_local
    _, _, files, _ = smollm2_files
    facts = from_gguf(files["Q4_1"], "float32")
    whole = facts.quantized("gguf").bytes_per_param * facts.params
    got, loaded = generate_local(RankSpec(files["Q4_1"], 3, 1, max_batch=1, max_seq=16, quantize="gguf"),
                                 [[1, 2, 3]], 2)
    assert len(got[0]) == 2
    for r in loaded:
        assert 0.33 < r["weight_bytes"] / whole < 0.34, (r["weight_bytes"], whole)


# ---------------------------------------------------------------- bad input


def test_gguf_blocks_of_a_safetensors_model_is_one_line(tmp_path):
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(_small_llama(tmp_path, "float32"), quantize="gguf"))
    assert "--quantize gguf keeps a GGUF file's Q8_0, Q4_0, Q4_1 blocks" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_type_without_a_fast_path_is_dequantized_with_a_notice(tmp_path):
    from shardwise.worker.weights.gguf_index import write_requantized
    from shardwise.worker.weights.loader import builtin_model_path
    _smollm2()
    q5 = str(tmp_path / "smollm2-q5_0.gguf")
    write_requantized(builtin_model_path("smollm2"), q5, "Q5_0")
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", q5, "--prompt",
                        "The capital of France is", "--max-new-tokens", "4", "--quantize", "gguf"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    notices = [line for line in p.stderr.splitlines() if line.startswith("notice:")]
    assert notices == ["notice: 210 Q5_0 layer matrices have no fast path and are dequantized to "
                       "float32 (kept as stored: Q8_0, Q4_0, Q4_1)"], p.stderr
    assert "Traceback" not in p.stderr and p.stdout.strip()
