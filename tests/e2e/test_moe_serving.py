"""End to end on local nodes (pods run as processes): a ShardedModel of a mixture-of-experts model
(a random-weight Mixtral-shaped checkpoint in a local directory, its 4 experts split over a tensor
group of 2, in 2 pipeline stages) is planned by the operator from the model's own config.json, served by the real worker pods,
and its endpoint answers a completion with the tokens the same model gives locally.

Marked `slow` and `controlplane`, like the other worker end-to-end tests."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from .test_operator_worker import CRD, complete, serving_ip, wait

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.timeout(600)]
TENSOR, PIPELINE, EXPERTS = 2, 2, 4
PROMPT = "the quick brown fox"


def _moe_model(path):
    """A Mixtral-shaped checkpoint with a tokenizer (write_tiny_model's, trained on a short text)."""
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig, MixtralForCausalLM

    from shardwise.worker.weights.tiny import write_tiny_model
    text = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. " * 20
    tiny = write_tiny_model(path / "tiny", text, layers=1)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                     num_experts_per_tok=2, max_position_embeddings=256)).save_pretrained(path / "moe")
    shutil.copy(tiny / "tokenizer.json", path / "moe")
    return path / "moe"


def _local_answer(model: str) -> str:
    from shardwise.worker.weights.loader import open_model
    from shardwise.worker.serving.rank import RankSpec, generate_local
    from shardwise.worker.weights.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(open_model(model))
    got, _ = generate_local(RankSpec(model, 1, 1, max_batch=1, max_seq=64), [tokenizer.encode(PROMPT)], 8)
    return tokenizer.decode(got[0])


def test_a_mixture_of_experts_model_answers_a_completion(cluster, namespace, kubectl, node_factory, tmp_path):
    model = str(_moe_model(tmp_path))
    expected = _local_answer(model)
    cluster.install_crd(CRD)
    label = {"shardwise.dev/test": namespace}
    for i in range(PIPELINE):
        node_factory(f"{namespace[-6:]}-moe-{i}", TENSOR, local=True, rack=f"rack-{namespace[-6:]}", labels=label)
    with cluster.operator(namespace, tmp_path / "operator.log"):
        sm = {"apiVersion": "shardwise.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": "moe"},
              "spec": {"model": {"uri": f"file://{model}"},
                       "parallelism": {"expert": TENSOR, "pipeline": PIPELINE, "replicas": 1},
                       "placement": {"nodeSelector": label},
                       "recovery": {"backoffSeconds": 1, "maxRestarts": 3}}}
        kubectl("apply", "-f", "-", input=json.dumps(sm))

        t0 = time.monotonic()
        ip = wait(lambda: serving_ip(kubectl, "moe"), 300, "moe Ready")
        plan = json.loads(kubectl("get", "sm", "moe", "-o", "json"))["status"]["plan"]
        print(f"created -> Ready in {time.monotonic() - t0:.1f}s: tensor {plan['tensor']} x pipeline {plan['pipeline']}")
        assert (plan["tensor"], plan["pipeline"]) == (TENSOR, PIPELINE)     # 2 experts a rank, 2 stages
        assert complete(ip, PROMPT) == expected
