"""Training on PyTorch's parallel stack gives the single-process losses in every layout.

Real local processes talking gloo through `shardwise train`: FSDP2 (ZeRO-3), DTensor tensor
parallel (with and without sequence parallelism), HSDP, the pipelining schedules and context
parallelism (each sequence split over ranks), 10 steps each (a checkpoint at the 10th), against
one process on the same data and seed (fp32 on CPU: relative gap under 1e-3 at every step). Checkpoints written in one layout
resume in another with the same losses, and a compressed run resumes its error feedback. Bad
layouts are refused in one line naming the option."""
from __future__ import annotations

import math
import shutil

import pytest
from safetensors import safe_open

from shardwise.worker.training import checkpoint as ckpt

STEPS = 20
LAYOUT_STEPS = 10      # each layout: enough to show parity through a checkpoint, at half the time
RTOL = 1e-3
COMMON = ["--checkpoint-every", "10", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3",
          "--seed", "11", "--json"]


@pytest.fixture(scope="module")
def single(work, train):
    records = train.run(work / "single", check=True).records
    assert records[STEPS]["loss"] < records[1]["loss"] * 0.8        # it learns
    return records


def _assert_parity(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=RTOL), f"step {s}"
        # The gradient norm counts every element once whatever the sharding (clipping depends on it).
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-2), f"step {s}"


LAYOUTS = {
    "FSDP2": ["--data-parallel", "2"],
    "FSDP2xTP2": ["--data-parallel", "2", "--tensor-parallel", "2"],
    "PP2-GPipe": ["--pipeline-parallel", "2", "--schedule", "GPipe"],
    "PP2-1F1B": ["--pipeline-parallel", "2", "--schedule", "1F1B"],
    "PP2-Interleaved1F1B": ["--pipeline-parallel", "2", "--schedule", "Interleaved1F1B"],
    "HSDP2x2": ["--data-parallel", "4", "--data-shard", "2"],
    "FSDP2-recompute": ["--data-parallel", "2", "--activation-checkpointing"],
    "FSDP2-prefetch2": ["--data-parallel", "2", "--prefetch-depth", "2"],
    "PP2xFSDP2xTP2": ["--pipeline-parallel", "2", "--data-parallel", "2", "--tensor-parallel", "2"],
    # sequence parallelism: norms and the activations between sub-layers split over the sequence
    "TP2-SP": ["--tensor-parallel", "2", "--sequence-parallel"],
    "PP2xFSDP2xTP2-SP": ["--pipeline-parallel", "2", "--data-parallel", "2", "--tensor-parallel", "2",
                         "--sequence-parallel"],
    # context parallelism: each sequence split over the ranks, keys and values gathered per layer
    "CP2": ["--context-parallel", "2"],
    "CP2xFSDP2": ["--context-parallel", "2", "--data-parallel", "2"],
    "CP2xTP2-SP": ["--context-parallel", "2", "--tensor-parallel", "2", "--sequence-parallel"],
    "PP2xCP2": ["--pipeline-parallel", "2", "--context-parallel", "2"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_trains_like_one_process(train, single, tmp_path, name):
    got = train.run(tmp_path / "ck", *LAYOUTS[name], "--steps", str(LAYOUT_STEPS), check=True).records
    assert sorted(got) == list(range(1, LAYOUT_STEPS + 1))
    _assert_parity(got, single, range(1, LAYOUT_STEPS + 1))


def test_int8_compression_sends_a_quarter_of_the_bytes_and_keeps_the_loss(train, single, tmp_path):
    """Two replicate groups (DP=2, shard 1): the gradient average between them, plain vs INT8."""
    plain = train.run(tmp_path / "plain", "--data-parallel", "2", "--data-shard", "1", check=True).records
    int8 = train.run(tmp_path / "int8", "--data-parallel", "2", "--data-shard", "1", "--compression", "int8",
                     check=True).records
    _assert_parity(plain, single, range(1, STEPS + 1))
    ratio = int8[STEPS]["replicate_bytes"] / plain[STEPS]["replicate_bytes"]
    assert 0.24 < ratio < 0.27, ratio
    assert int8[STEPS]["loss"] == pytest.approx(plain[STEPS]["loss"], rel=0.01)


def test_zero3_checkpoint_resumes_under_other_layouts_with_the_same_losses(train, single, tmp_path):
    """Saved under FSDP=2 × TP=2, resumed under PP=2 × DP=2 (replicated) and under FSDP=4."""
    saved = tmp_path / "saved"
    train.run(saved, "--data-parallel", "2", "--tensor-parallel", "2", "--steps", "10", check=True)
    for name, layout in {"PP2xDP2": ["--pipeline-parallel", "2", "--data-parallel", "2", "--data-shard", "1"],
                         "FSDP4": ["--data-parallel", "4"]}.items():
        ckdir = tmp_path / name
        ckdir.mkdir()
        shutil.copytree(saved / ckpt.step_dir_name(10), ckdir / ckpt.step_dir_name(10))
        _, got, err = train.run(ckdir, *layout, check=True)
        assert "resumed from checkpoint step 10 (saved under TP=2 PP=1 DP=2 (FSDP=2)" in err, err
        assert sorted(got) == list(range(11, STEPS + 1)), name        # no step done twice
        _assert_parity(got, single, range(11, STEPS + 1))


def test_a_context_parallel_checkpoint_resumes_under_another_context_degree(train, single, tmp_path):
    """Saved with each sequence split over 2 ranks, resumed with it split over 4 (8 chunks of 4
    tokens): the parameters are replicated over the context ranks, so any degree reads them, and
    the losses go on as one process's."""
    ckdir = tmp_path / "ck"
    train.run(ckdir, "--context-parallel", "2", "--steps", "4", check=True)
    _, got, err = train.run(ckdir, "--context-parallel", "4", "--steps", "6", check=True)
    assert "resumed from checkpoint step 4 (saved under TP=1 PP=1 DP=1 CP=2, now TP=1 PP=1 DP=1 CP=4)" in err, err
    assert sorted(got) == [5, 6]
    _assert_parity(got, single, [5, 6])


@pytest.mark.parametrize("method", [["--compression", "topk", "--compression-density", "0.05"],
                                    ["--compression", "topk-int4", "--compression-warmup", "3"],
                                    ["--compression", "powersgd", "--compression-rank", "2"]],
                         ids=["topk", "topk-int4-frozen-variance", "powersgd"])
def test_a_compressed_run_resumed_mid_run_gives_the_uninterrupted_losses(train, tmp_path, method):
    """The error-feedback residuals are in the checkpoint: a run stopped at step 10 and resumed goes on
    exactly as the run that never stopped (without them, what compression still owed is lost)."""
    two_groups = ["--data-parallel", "2", "--data-shard", "1", *method]
    whole = train.run(tmp_path / "whole", *two_groups, check=True).records
    resumed_dir = tmp_path / "resumed"
    train.run(resumed_dir, *two_groups, "--steps", "10", check=True)
    _, resumed, err = train.run(resumed_dir, *two_groups, check=True)
    assert sorted(resumed) == list(range(11, STEPS + 1)), err
    for s in range(11, STEPS + 1):
        assert resumed[s]["loss"] == pytest.approx(whole[s]["loss"], rel=1e-6, abs=0), f"step {s}"
        assert resumed[s]["replicate_bytes"] == whole[s]["replicate_bytes"]


def test_compression_residuals_reshard_to_another_layout_and_replicate_count(train, tmp_path):
    """Saved by 2 replicate groups at step 10 (PowerSGD, rank 2); resumed sharded over 2 ranks per
    group (the residual slices read in their new split; PowerSGD's bases, which belong to a shard's
    matrix, restart, saying so) and by 4 groups (each residual starting from the mean of the 2 saved;
    the bases, the same in every group, read back)."""
    psgd = ["--compression", "powersgd", "--compression-rank", "2"]
    saved = tmp_path / "saved"
    train.run(saved, "--data-parallel", "2", "--data-shard", "1", *psgd, "--steps", "10", check=True)
    for name, layout, news in [
            ("sharded", ["--data-parallel", "4", "--data-shard", "2"],
             ["compression residuals of 2 replicate groups resumed",
              "restart from their initial values: they were saved for another split of the gradients"]),
            ("four-groups", ["--data-parallel", "4", "--data-shard", "1"],
             ["compression residuals saved by 2 replicate groups, resumed by 4: each starts from their mean",
              "PowerSGD bases resumed"])]:
        ckdir = tmp_path / name
        ckdir.mkdir()
        shutil.copytree(saved / ckpt.step_dir_name(10), ckdir / ckpt.step_dir_name(10))
        _, got, err = train.run(ckdir, *layout, *psgd, "--steps", "12", check=True)
        assert all(n in err for n in news), err
        assert sorted(got) == [11, 12] and all(math.isfinite(r["loss"]) for r in got.values())


def test_powersgd_trains_two_replicas_sending_what_the_shapes_say(train, work, tmp_path):
    """Two replicate groups averaged by PowerSGD at rank 2: the loss falls, and each step sends 4 (rows + cols) * 2 bytes per weight matrix plus the norms whole."""
    got = train.run(tmp_path / "ck", "--data-parallel", "2", "--data-shard", "1", "--compression", "powersgd",
                    "--compression-rank", "2", check=True).records
    assert got[STEPS]["loss"] < got[1]["loss"] * 0.8, got[STEPS]        # it learns
    with safe_open(str(work / "model" / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    dense = 4 * sum(math.prod(s) for s in shapes)
    expected = sum(4 * (s[0] + s[1]) * 2 if len(s) == 2 and (s[0] + s[1]) * 2 * 2 < s[0] * s[1]
                   else 4 * math.prod(s) for s in shapes)
    assert all(r["replicate_bytes"] == expected for r in got.values()), (got[1]["replicate_bytes"], expected)
    assert expected / dense < 0.06, expected / dense


@pytest.mark.parametrize("extra, message", [
    (["--data-parallel", "4", "--data-shard", "3"], "data-parallel shard degree 3 does not divide the 4"),
    (["--tensor-parallel", "3"], "tensor parallel degree 3 does not divide"),
    (["--pipeline-parallel", "5"], "pipeline parallel degree 5 is more stages than the model's 4 layers"),
    (["--pipeline-parallel", "3", "--schedule", "Interleaved1F1B"],
     "Interleaved1F1B with 3 pipeline ranks needs 6 stages, more than the model's 4 layers"),
    (["--schedule", "ZeroBubble"], "invalid choice: 'ZeroBubble'"),
    (["--data-parallel", "2", "--data-shard", "1", "--compression", "topk", "--compression-density", "0"],
     "compression density must be in (0, 1], got 0.0"),
    (["--data-parallel", "2", "--data-shard", "1", "--compression", "topk", "--compression-density", "1.5"],
     "compression density must be in (0, 1], got 1.5"),
    (["--data-parallel", "2", "--data-shard", "1", "--compression", "powersgd", "--compression-rank", "0"],
     "compression rank must be 1 to 256, got 0"),
    (["--data-parallel", "2", "--prefetch-depth", "9"], "prefetch depth must be 0 to 8 blocks, got 9"),
    (["--tensor-parallel", "2", "--sequence-parallel", "--seq-len", "33"],
     "sequence parallelism splits each sequence over the 2 tensor-parallel ranks: sequence length 33 is not "
     "a multiple of 2"),
    (["--data-parallel", "2", "--data-shard", "1", "--compression", "int4", "--compression-warmup", "-1"],
     "compression warm-up must be 0 or more steps, got -1"),
    (["--data-parallel", "2", "--compression", "int8"],
     "gradient compression works across replicate groups: --data-shard 2 leaves none of the 2 replicas"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--context-parallel", "0"], "--context-parallel must be at least 1"),
    (["--context-parallel", "2", "--seq-len", "30"],
     "context parallelism splits each sequence into 2 x 2 = 4 chunks: sequence length 30 is not a multiple of 4"),
])
def test_a_bad_layout_is_one_line_naming_the_option(train, tmp_path, extra, message):
    code, _, stderr = train.run(tmp_path / "ck", *extra, timeout=120)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert message in lines[-1], stderr
    assert len(lines) == 1 or lines[0].startswith("usage:"), stderr    # argparse shows the usage first
    assert not (tmp_path / "ck").exists()          # refused before any rank started
