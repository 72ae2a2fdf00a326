"""Mixture-of-experts models (worker/model/moe.py): greedy parity with transformers for random-weight
Mixtral-, Qwen2-MoE- (shared expert, q/k/v biases) and Qwen3-MoE-shaped models under expert parallel
(EP = TP) x pipeline stages, what a rank holds of the experts, and one-line errors on bad input. Real processes talking torch.distributed throughout."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.serving.rank import LocalRuntime, RankSpec, generate_local, validate

PROMPTS = [[1, 5, 9, 22, 7, 40, 3], [3, 4], [100, 2, 77, 61]]
NEW_TOKENS = 12

# name -> (family, experts, experts per token, kv heads). Odd and non-power-of-two expert counts,
# top-2 (Mixtral's own) and top-8; Qwen3-MoE with and without renormalised top-k weights, its
# per-head q/k norms, and a head_dim that is not hidden / heads; Qwen2-MoE with its shared expert
# (a width that is not the routed experts') and q/k/v biases, odd expert counts and top-8.
SHAPES = {"8e-top2": ("mixtral", 8, 2, 4), "5e-top2": ("mixtral", 5, 2, 2), "12e-top8": ("mixtral", 12, 8, 4),
          "qwen3-6e-top2": ("qwen3_moe", 6, 2, 2), "qwen3-12e-top8-norm": ("qwen3_moe", 12, 8, 4),
          "qwen2-7e-top2": ("qwen2_moe", 7, 2, 2), "qwen2-8e-top2": ("qwen2_moe", 8, 2, 4),
          "qwen2-12e-top8-norm": ("qwen2_moe", 12, 8, 4)}


def _moe(tmp_path_factory, name: str) -> tuple[str, list[list[int]]]:
    family, experts, top_k, kv = SHAPES[name]
    torch.manual_seed(len(name) + experts)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=kv, num_experts_per_tok=top_k, max_position_embeddings=128)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=96, num_local_experts=experts))
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                                   shared_expert_intermediate_size=80, num_experts=experts,
                                                   norm_topk_prob=name.endswith("norm")))
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                                   num_experts=experts, head_dim=32,
                                                   norm_topk_prob=name.endswith("norm")))
    model.eval()
    with torch.no_grad():     # a router that prefers some experts, and q/k norms that are not all ones
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(4)
            for norm in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, norm):
                    getattr(layer.self_attn, norm).weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "shared_expert_gate"):
                # a gate that opens for some tokens and closes for others (not ~0.5 for all), a
                # shared expert loud enough that the tokens change without it or with a constant
                # gate, and biases that matter (transformers starts them at 0)
                layer.mlp.shared_expert_gate.weight.mul_(20)
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    getattr(layer.mlp.shared_expert, proj).weight.mul_(6)
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.uniform_(-1, 1)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
            ref.append(out[0, len(p):].tolist())
    return str(path), ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: _moe(tmp_path_factory, name) for name in SHAPES}


@pytest.mark.parametrize("name,ep,pp", [("8e-top2", 1, 1), ("8e-top2", 2, 1), ("8e-top2", 4, 1),
                                        ("8e-top2", 2, 2), ("8e-top2", 4, 2), ("5e-top2", 1, 2),
                                        ("12e-top8", 2, 1), ("12e-top8", 4, 2),
                                        ("qwen3-6e-top2", 1, 1), ("qwen3-6e-top2", 2, 2),
                                        ("qwen3-12e-top8-norm", 2, 1), ("qwen3-12e-top8-norm", 4, 2),
                                        ("qwen2-7e-top2", 1, 1), ("qwen2-7e-top2", 1, 2),
                                        ("qwen2-8e-top2", 2, 1), ("qwen2-8e-top2", 4, 1), ("qwen2-8e-top2", 2, 2),
                                        ("qwen2-12e-top8-norm", 2, 2), ("qwen2-12e-top8-norm", 4, 2)])
def test_greedy_tokens_match_transformers(models, name, ep, pp):
    path, ref = models[name]
    got, _ = generate_local(RankSpec(path, ep, pp, max_batch=len(PROMPTS), max_seq=64), PROMPTS, NEW_TOKENS)
    assert got == ref


@pytest.mark.parametrize("name", ["8e-top2", "qwen2-8e-top2"])
def test_a_rank_holds_its_share_of_the_experts(models, name):
    """Under EP 4 a rank holds a quarter of the routed experts and of the shared expert (split
    tensor-parallel); only the shared expert's [1, hidden] gate is replicated."""
    path, _ = models[name]
    stacks, shared = {}, {}
    for ep in (1, 4):
        with LocalRuntime(RankSpec(path, ep, 1, max_batch=1, max_seq=16)) as ctx:
            ffn = ctx.stage.model.layers["0"].feed_forward
            stacks[ep] = ffn.w1.numel() + ffn.w2.numel() + ffn.w3.numel()
            assert ffn.w1.shape[0] == 8 // ep and ffn.expert_start == 0       # rank 0: the first experts
            if ffn.shared_expert is not None:       # fused for inference: w13 [H, 2I/ep], w2 [I/ep, H]
                shared[ep] = sum(p.numel() for p in ffn.shared_expert.parameters())
                assert ffn.shared_expert_gate.weight.shape == (1, 64)
    assert stacks[4] * 4 == stacks[1]
    assert shared.get(4, 0) * 4 == shared.get(1, 0) and (name == "8e-top2") == (not shared)


def test_expert_counts_follow_the_router(models):
    """Every token goes to top-k experts: the counts over all experts sum to tokens x k."""
    path, _ = models["8e-top2"]
    with LocalRuntime(RankSpec(path, 1, 1, max_batch=1, max_seq=32)) as ctx:
        from shardwise.worker.serving.engine import Engine
        from shardwise.worker.serving.request import Request
        Engine(ctx.stage, 1, ctx.max_seq, []).generate([Request(PROMPTS[0], max_new_tokens=4)])
        counts = ctx.stage.model.layers["0"].feed_forward.tokens_per_expert
        # 7 prompt tokens, then 3 decode steps of one token (the 4th token is never fed back)
        assert int(counts.sum()) == (len(PROMPTS[0]) + 3) * 2


# ---------------------------------------------------------------- bad input


def test_expert_degree_that_does_not_divide_lists_the_ones_that_do(models):
    path, _ = models["5e-top2"]
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(path, 2, 1))
    assert str(e.value) == ("expert parallel degree 2 (the tensor parallel degree: experts split across its "
                            "group) does not divide the model's 5 experts; use one of: 1")
    path, _ = models["12e-top8"]
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(path, 8, 1))
    assert "does not divide the model's 4 attention heads" in str(e.value)


def test_unsupported_moe_architecture_is_named_in_one_line(tmp_path):
    """DeepSeek-V3 (multi-head latent attention) is refused from its config alone."""
    from transformers import DeepseekV3Config
    DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, n_routed_experts=4,
                     architectures=["DeepseekV3ForCausalLM"]).save_pretrained(tmp_path)
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", str(tmp_path), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert f"{tmp_path}: unsupported architecture 'DeepseekV3ForCausalLM' (supported: LlamaForCausalLM, " \
           f"MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)" in p.stderr


@pytest.mark.parametrize("field,value,said", [
    ("decoder_sparse_step", 2, "decoder_sparse_step 2 (dense MLP layers between the expert layers) is not "
                               "supported; only 1, every layer a mixture of experts"),
    ("mlp_only_layers", [1], "mlp_only_layers [1] (dense MLP layers among the expert layers) is not "
                             "supported; only [], every layer a mixture of experts")])
def test_dense_layers_among_the_experts_are_refused_naming_the_field(models, tmp_path, field, value, said):
    import shutil
    path, _ = models["qwen2-7e-top2"]
    config = json.loads(open(f"{path}/config.json").read())
    config[field] = value
    shutil.copy(f"{path}/model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(str(tmp_path)))
    assert str(e.value) == f"{tmp_path}: {said}"


def test_a_degree_that_does_not_split_the_shared_expert_is_one_line(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=18, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)
                        ).save_pretrained(tmp_path)
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(str(tmp_path), 4, 1))
    assert str(e.value) == "tensor parallel degree 4 does not divide the shared expert's intermediate size 18; " \
                           "use one of: 1, 2"


def test_graphs_on_a_moe_model_is_refused_in_one_line(models):
    path, _ = models["8e-top2"]
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(path, decode="compile"))
    assert "cannot run a mixture-of-experts model" in str(e.value)


def test_quantizing_a_moe_model_is_refused_in_one_line(models):
    path, _ = models["8e-top2"]
    with pytest.raises(WorkerError) as e:
        validate(RankSpec(path, quantize="int8"))
    assert str(e.value) == "--quantize int8 does not cover mixture-of-experts layers yet; use none"


# ---------------------------------------------------------------- load balance in /metrics


def test_metrics_show_tokens_per_expert_and_the_imbalance(tmp_path, tiny_model):
    """A served Mixtral-shaped model under EP 2: /metrics counts, per layer, the tokens routed to
    every expert (rank 0 routes all tokens, so it counts the experts it does not hold too) and the
    max/mean imbalance."""
    import re
    import shutil
    import threading

    from transformers import MixtralConfig, MixtralForCausalLM

    from shardwise.worker.serving.http.server import App, Server, run_engine
    from shardwise.worker.weights.tokenizer import load_tokenizer

    from ..serving.test_server import _get, _post
    tiny = tiny_model(tmp_path / "tiny", layers=1)                       # for its tokenizer
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                     num_experts_per_tok=2)).save_pretrained(tmp_path / "moe")
    shutil.copy(tiny / "tokenizer.json", tmp_path / "moe")
    runtime = LocalRuntime(RankSpec(str(tmp_path / "moe"), 2, 1, max_batch=2, max_seq=64))
    app = App("moe", load_tokenizer(runtime.source))
    server = Server(app, "127.0.0.1", 0).start()
    stop = threading.Event()
    loop = threading.Thread(target=run_engine, args=(app, runtime.start(), stop), daemon=True)
    loop.start()
    try:
        assert app.ready.wait(60)
        base = f"http://127.0.0.1:{server.port}"
        status, body = _post(base + "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 6,
                                                        "temperature": 0})
        assert status == 200, body
        usage = json.loads(body)["usage"]
        fed = usage["prompt_tokens"] + usage["completion_tokens"] - 1     # the last token is never fed back
        status, text = _get(base + "/metrics")
        text = text.decode()
        for layer in ("0", "1"):
            counts = [int(float(n)) for e in range(4) for n in re.findall(
                rf'^shardwise_expert_tokens_total{{expert="{e}",layer="{layer}"}} (\S+)$', text, re.M)]
            assert len(counts) == 4 and sum(counts) == fed * 2, (layer, counts, text)
            ratio = float(re.search(rf'^shardwise_expert_imbalance{{layer="{layer}"}} (\S+)$', text, re.M).group(1))
            assert ratio == pytest.approx(max(counts) / (sum(counts) / 4))
    finally:
        stop.set()
        loop.join(30)
        runtime.stop()
        server.close()
