"""Layer streaming (worker/weights/offload.py): under a weight budget smaller than the model, the layers
that do not fit run from two slots they are copied into ahead of their turn, and give the logits
of the model held whole. On CPU the copies are synchronous; the code path is the one a GPU runs."""
from __future__ import annotations

import copy

import pytest
import torch

from shardwise.worker.distributed.placement import place_in_huge_pages
from shardwise.worker.errors import WorkerError
from shardwise.worker.model.inference import install_fused_weights
from shardwise.worker.model.llama import ModelConfig, Transformer
from shardwise.worker.serving.cache_view import cache_view
from shardwise.worker.weights.offload import apply_offload, packing, parse_bytes, plan_offload, tensor_bytes

CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_heads=8, num_kv_heads=2,
              rope_theta=10000.0, max_position_embeddings=64)


def fused_model(layers: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(num_layers=layers, tie_word_embeddings=True, **CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    install_fused_weights(model.eval())
    place_in_huge_pages(model)
    return model


def step(model: Transformer, tokens: list[list[int]], positions: list[list[int]], blocks: list[int]) -> torch.Tensor:
    """The last position's logits of one cached step (each row one block of the whole context)."""
    positions = torch.tensor(positions)
    cache = cache_view(model, positions, torch.tensor(blocks))
    return model(torch.tensor(tokens), positions=positions, cache=cache, last_only=True)[:, -1]


def budgets(model: Transformer) -> tuple[int, int, int]:
    """(bytes outside the layers, one packed layer, the whole model)"""
    layer = packing(model.layers["0"])[1]
    fixed = tensor_bytes(model) - sum(tensor_bytes(x) for x in model.layers.values())
    return fixed, layer, fixed + len(model.layers) * layer


def run(model: Transformer, prompts: list[list[int]], new: int) -> list[torch.Tensor]:
    """Every step's logits of greedy generation, prompts prefilled one by one then decoded together."""
    model.setup_caches(len(prompts), 48)
    seqs, out = [list(p) for p in prompts], []
    with torch.no_grad():
        for slot, seq in enumerate(seqs):
            logits = step(model, [seq], [list(range(len(seq)))], [slot])
            out.append(logits)
            seq.append(int(logits[0].argmax()))
        for _ in range(new):
            logits = step(model, [[s[-1]] for s in seqs], [[len(s) - 1] for s in seqs], list(range(len(seqs))))
            out.append(logits)
            for row, seq in enumerate(seqs):
                seq.append(int(logits[row].argmax()))
    return out


@pytest.mark.parametrize("layers,resident", [(6, 1), (5, 0), (7, 2)],
                         ids=["even-streamed", "odd-streamed", "odd-with-resident"])
def test_streamed_layers_give_the_whole_model_logits(layers, resident):
    whole = fused_model(layers)
    fixed, layer, total = budgets(whole)
    streamed = copy.deepcopy(whole)
    plan = apply_offload(streamed, fixed + (2 + resident) * layer, "cpu")
    assert len(plan.resident) == resident and len(plan.streamed) == layers - resident
    assert plan.device_bytes <= fixed + (2 + resident) * layer < total
    prompts = [[5, 6, 7, 8, 9], [100, 3, 77], [1, 2]]
    want, got = run(whole, prompts, 6), run(streamed, prompts, 6)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # every streamed layer was copied in for every step (two or fewer stay in their slots)
    steps = len(prompts) + 6
    if len(plan.streamed) > 2:
        assert streamed.before_layer.__self__.copy_bytes >= steps * len(plan.streamed) * layer


def test_a_budget_that_holds_everything_streams_nothing():
    model = fused_model(4)
    _, _, total = budgets(model)
    plan = apply_offload(model, total, "cpu")
    assert plan.streamed == () and model.before_layer is None


def test_a_budget_below_two_layers_is_refused_naming_the_smallest():
    model = fused_model(4)
    fixed, layer, _ = budgets(model)
    with pytest.raises(WorkerError) as e:
        plan_offload(model, fixed + layer)
    smallest_mib = -(-(fixed + 2 * layer) // 2 ** 20)
    assert "\n" not in str(e.value)
    assert f"the smallest that works for this stage, {smallest_mib} MiB" in str(e.value)
    plan_offload(model, fixed + 2 * layer)      # that one works


@pytest.mark.parametrize("text,value", [("512MiB", 512 * 2 ** 20), ("2GiB", 2 * 2 ** 30), ("1.5GB", 1_500_000_000),
                                        ("1000", 1000)])
def test_budget_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "-1MiB", "5 parsecs"])
def test_bad_budget_sizes_are_one_line(text):
    with pytest.raises(WorkerError, match="is not a size"):
        parse_bytes(text)


# ------------------------------------------------------------------ through the worker's launch

def smollm2_or_skip() -> str:
    from shardwise.worker.weights.loader import builtin_model_path
    try:
        builtin_model_path("smollm2")
    except WorkerError as e:
        pytest.skip(str(e))
    return "smollm2"


@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 2)])
def test_streamed_smollm2_generates_the_tokens_of_the_whole_model(tp, pp):
    """SmolLM2 (fp32: 110 MiB of tied embedding per first/last stage, 17 MiB a layer) under
    budgets that keep 1-3 of each rank's layers resident: every rank streams the rest."""
    from shardwise.worker.serving.rank import RankSpec, generate_local
    model = smollm2_or_skip()
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 563, 1412, 19348, 30, 94, 33]]
    want, _ = generate_local(RankSpec(model, tp, pp, max_batch=2, max_seq=48), prompts, 8)
    budget = (160 if tp == 1 else 60) * 2 ** 20
    got, loaded = generate_local(RankSpec(model, tp, pp, max_batch=2, max_seq=48, offload_budget=budget), prompts, 8)
    assert got == want


def test_streamed_int8_layers_generate_the_int8_tokens():
    """Streaming packs whatever a layer holds: INT8 matrices and their scales too."""
    from shardwise.worker.serving.rank import RankSpec, generate_local
    model = smollm2_or_skip()
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    want, _ = generate_local(RankSpec(model, max_batch=1, max_seq=32, quantize="int8"), prompts, 8)
    got, _ = generate_local(RankSpec(model, max_batch=1, max_seq=32, quantize="int8", offload_budget=130 * 2 ** 20),
                            prompts, 8)
    assert got == want


def test_too_small_a_budget_is_one_line_naming_the_smallest(capsys):
    from shardwise.cli import main
    model = smollm2_or_skip()
    code = main(["generate", "--model", model, "--prompt", "Hi", "--max-new-tokens", "2", "--offload-budget", "8MiB"])
    last = capsys.readouterr().err.strip().splitlines()[-1]     # after the "loading ..." progress line
    assert code == 2 and last.startswith("shardwise generate: error: offload budget 8.0 MiB is below the "
                                         "smallest that works for this stage, 136 MiB")


def test_graphs_with_streaming_are_refused_before_loading(capsys):
    from shardwise.cli import main
    model = smollm2_or_skip()
    code = main(["generate", "--model", model, "--prompt", "Hi", "--decode", "compile", "--offload-budget", "1GiB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--decode compile cannot run layers streamed from host memory" in err
