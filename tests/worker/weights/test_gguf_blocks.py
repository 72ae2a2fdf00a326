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


def test_a_vocabulary_slice_of_blocks_is_the_files_rows_then_zero_rows():
    """Under tensor parallelism a rank holds rows of the (padded) vocabulary: whole rows of blocks,
    and past the file's last row zero blocks, which stand for zero rows as the float padding does."""
    from shardwise.worker.distributed.tensor_parallel import Shard
    from shardwise.worker.weights.loader import open_model
    _smollm2()
    source = open_model("smollm2")
    vocab = source.config.vocab_size
    for shard in (Shard(0, 1, 2, padded=vocab), Shard(0, 2, 3, padded=vocab + 3)):   # the last: 3 rows past the end
        start, stop = shard.bounds(vocab)
        blocks = source.read_blocks("tok_embeddings.weight", shard)
        want = source.read("tok_embeddings.weight", shard)          # dequantized and padded by the gguf package
        assert blocks.shape == tuple(want.shape) == (stop - start, source.config.hidden_size)
        v, scale, zero = int4_planes(blocks)
        rows = v.shape[0]
        w = ((v.reshape(rows, -1, BLOCK).astype(np.float64) - 8) * scale[..., None] + zero[..., None]).reshape(rows, -1)
        if blocks.qtype == "Q8_0":
            w = w[:, :w.shape[1] // 2] + w[:, w.shape[1] // 2:]
        assert np.array_equal(w, want.double().numpy())
        assert not w[vocab - start:].any()


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
        return [r.token_ids for r in reqs], math.exp(nll), ctx.loaded


@pytest.fixture(scope="module")
def wide_file(tmp_path_factory):
    """The built-in Q4_1 file with zero heads added (12 heads, 4 KV heads: gguf_index.write_widened),
    the same model, which TP 2 divides (SmolLM2's own 9 and 3 heads admit TP 1 and 3 only)."""
    from shardwise.worker.weights.gguf_index import write_widened
    from shardwise.worker.weights.loader import builtin_model_path
    _smollm2()
    wide = str(tmp_path_factory.mktemp("gguf") / "smollm2-12-heads.gguf")
    write_widened(builtin_model_path("smollm2"), wide, kv_heads=4)
    return wide


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory, wide_file):
    """The built-in Q4_1 file, a Q8_0 one made from it, the Q4_1 one widened for TP 2, and the
    dequantized reference of the first two (TP 1, PP 1, float32: the layouts of the dequantized
    model match transformers elsewhere); the widened file's reference is the Q4_1 file's."""
    from shardwise.worker.weights.gguf_index import write_requantized
    from shardwise.worker.weights.loader import builtin_model_path
    tok = _smollm2()
    prompts, text = [tok.encode(p) for p in PROMPTS], tok.encode(TEXT)
    q8 = str(tmp_path_factory.mktemp("gguf") / "smollm2-q8_0.gguf")
    write_requantized(builtin_model_path("smollm2"), q8, "Q8_0")
    files = {"Q4_1": builtin_model_path("smollm2"), "Q8_0": q8}
    refs = {k: _run(path, 1, 1, "none", prompts, text) for k, path in files.items()}
    files["Q4_1 widened"], refs["Q4_1 widened"] = wide_file, refs["Q4_1"]
    return prompts, text, files, refs


def _rank_bytes_in_blocks(path: str, loaded: list[dict], tp: int) -> list[float]:
    """What each rank holds when all of its matrices are the file's blocks: its stage's layer
    matrices and vocabulary tables (the embedding on the first stage, the head on the last; a tied
    pair on one stage is one table) split over the TP degree, plus its layers' float32 norms."""
    from shardwise.crds.modelshape import GGUF_NATIVE_BYTES, from_gguf
    f = from_gguf(path, "float32")
    matrices = f.layer_params - 2 * f.hidden
    stages = 1 + max(r["stage"] for r in loaded)
    out = []
    for r in loaded:
        layers = r["layers"][1] - r["layers"][0]
        tables = 1 if r["stage"] in (0, stages - 1) else 0          # tied: one table a stage that has either end
        blocks = layers * matrices * GGUF_NATIVE_BYTES[f.dtype] + tables * f.vocab * f.hidden * GGUF_NATIVE_BYTES[f.embedding_dtype]
        norms = (2 * layers + (r["stage"] == stages - 1)) * f.hidden * 4
        out.append(blocks / tp + norms)
    return out


# Q4_1 in every split; Q8_0, whose blocks are split by the same code, whole and split both ways
@pytest.mark.parametrize("qtype,tp,pp", [("Q4_1", 1, 1), ("Q4_1", 1, 2), ("Q4_1", 3, 1), ("Q4_1", 3, 2),
                                         ("Q4_1 widened", 2, 1), ("Q4_1 widened", 2, 2),
                                         ("Q8_0", 1, 1), ("Q8_0", 3, 2)])
def test_smollm2_blocks_match_the_dequantized_model(smollm2_files, qtype, tp, pp):
    """Every rank, under any TP x PP, holds its layer matrices and its vocabulary slice of the tied
    embedding/head (Q8_0 in both files) in the file's blocks, and decodes the dequantized model's
    tokens: the whole model at 0.19x of float32 for the Q4_1 file (0.33x with a float32 head). TP 2
    runs on the Q4_1 file widened to 12 heads, whose tokens are the Q4_1 file's."""
    prompts, text, files, refs = smollm2_files
    ref_tokens, ref_ppl, ref_loaded = refs[qtype]
    tokens, ppl, loaded = _run(files[qtype], tp, pp, "gguf", prompts, text)
    ref_bytes, q_bytes = ([r["weight_bytes"] for r in rs] for rs in (ref_loaded, loaded))
    assert tokens == ref_tokens
    assert abs(ppl / ref_ppl - 1) < 0.01, (ppl, ref_ppl)
    print(f"{qtype} tp={tp} pp={pp}: perplexity dequantized {ref_ppl:.4f} blocks {ppl:.4f}; "
          f"bytes {ref_bytes} -> {q_bytes}")
    # a float32 vocabulary slice would add 2.75 bytes an element to a rank: 39 MB at TP 2
    for got, want in zip(q_bytes, _rank_bytes_in_blocks(files[qtype], loaded, tp)):
        assert abs(got / want - 1) < 0.002, (got, want, loaded)
    if (tp, pp) == (1, 1) and qtype in ("Q4_1", "Q8_0"):
        # what the planner sizes a pod by (crds/modelshape.py ModelFacts.quantized: the head in blocks)
        from shardwise.crds.modelshape import from_gguf
        facts = from_gguf(files[qtype], "float32")
        assert q_bytes[0] == pytest.approx(facts.quantized("gguf").bytes_per_param * facts.params, rel=1e-3)
        assert q_bytes[0] < (0.2 if qtype == "Q4_1" else 0.33) * ref_bytes[0], (q_bytes, ref_bytes)


def _load_rank(path: str, tp_rank: int, tp: int, stage: int, pp: int):
    """One rank's stage built as setup_rank builds it under --quantize gguf, in this process; with
    one decoder layer (its first or its last) instead of the stage's share, to keep it quick."""
    from shardwise.worker.model.inference import install_fused_weights
    from shardwise.worker.weights.loader import load_stage, open_model
    from shardwise.worker.weights.quantize import quantize_weights
    source = open_model(path)
    start = 0 if stage == 0 else source.config.num_layers - 1
    model = load_stage(source, start, start + 1, stage == 0, stage == pp - 1, tp_rank, tp, keep_blocks=True)
    install_fused_weights(model)
    quantize_weights(model, "gguf")
    return source, model


@pytest.mark.parametrize("tp,pp", [(2, 1), (3, 1), (2, 2)])
def test_every_tp_rank_keeps_its_vocabulary_slice_of_blocks(wide_file, tp, pp):
    """The embedding and the head of every rank are its rows of the file's blocks, no float table
    beside them: a tied pair on one stage is one BlockLinear, read by the lookup and the head."""
    from shardwise.worker.weights.gguf_blocks import BlockEmbedding
    for stage in range(pp):
        for r in range(tp):
            source, model = _load_rank("smollm2" if tp == 3 else wide_file, r, tp, stage, pp)
            vocab = source.config.vocab_size
            start, stop = r * vocab // tp, (r + 1) * vocab // tp
            ids = torch.tensor([[0, 7, stop - start - 1]])
            want = source.read("tok_embeddings.weight", model.tp_shards["tok_embeddings.weight" if stage == 0
                                                                       else "output.weight"])[ids]
            tables = []
            if stage == 0:
                emb = model.tok_embeddings
                assert isinstance(emb.lookup, BlockEmbedding) and emb.weight is None and emb.weight_t is None
                assert torch.allclose(emb.lookup(ids), want, rtol=1e-2, atol=1e-3)
                tables.append(emb.lookup.table)
            if stage == pp - 1:
                head = model.output
                assert isinstance(head.matrix, BlockLinear) and head.weight is None and head.weight_t is None
                assert head.matrix.out_features == stop - start
                h = torch.randn(2, source.config.hidden_size)
                got, ref = head.matrix(h)[:, ids[0]], h @ want[0].t()
                assert float((got - ref).abs().max()) < 1e-2 * float(ref.abs().max())
                tables.append(head.matrix)
            assert len({id(t) for t in tables}) == 1                 # tied: one table per rank
            assert not any(p.dtype.is_floating_point and p.dim() == 2 and stop - start in p.shape
                           for p in model.parameters())              # no float vocabulary table


def test_each_rank_keeps_only_its_slice(smollm2_files):
    """Under TP 3 each rank holds a third of the whole (the layer matrices' blocks split by rows or
    by whole blocks of columns; the tied embedding/head's blocks split by vocabulary rows)."""
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
