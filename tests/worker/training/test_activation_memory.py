"""The planner's training activation model (operator/planning/activations.py) against what the
worker's own Llama model saves for backward: one forward on CPU inside saved_tensors_hooks, the
bytes of the distinct storages saved (parameters left out), per decoder layer as the difference
between a 4-layer and a 2-layer model (the embedding, the rotary table and the head cancel).

The CPU path runs SDPA's fused kernel with enable_gqa (keys and values at their own KV-head width,
no s x s matrix); the GPU path repeats them per query head first, which the planner counts
(repeat_kv, its default): on this model that is 5.9% more than the CPU measures."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardwise.operator.planning.activations import ActivationShape, layer_activation_bytes, logits_bytes
from shardwise.worker.model.llama import ModelConfig, Transformer

# The tiny model of the training tests (worker/weights/tiny.py's defaults).
TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
            max_position_embeddings=1024)
BATCH = 2
SEQS = (64, 128, 256)
TOLERANCE = 0.10          # the GPU form against the CPU measurement
CPU_TOLERANCE = 0.01      # the CPU form (keys and values at their own width): the same tensors


def saved_bytes(layers: int, seq: int, checkpointing: bool, loss: bool = False) -> int:
    """Bytes of the distinct non-parameter storages one forward saves for backward."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(num_layers=layers, **TINY))
    if checkpointing:   # as worker/training/parallelize.apply_activation_checkpointing does it
        for block in model.layers.values():
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, return_hidden=not loss)
        if loss:   # as worker/training/trainer._loss computes it
            F.cross_entropy(out.float().reshape(-1, out.shape[-1]), tokens.reshape(-1))
    return sum(saved.values())


def measured_per_layer(seq: int, checkpointing: bool) -> float:
    return (saved_bytes(4, seq, checkpointing) - saved_bytes(2, seq, checkpointing)) / 2


def modelled(seq: int, checkpointing: bool, repeat_kv: bool) -> float:
    facts = ModelConfig(num_layers=4, **TINY).facts()
    return layer_activation_bytes(facts, ActivationShape(seq, BATCH, 4, checkpointing=checkpointing,
                                                         repeat_kv=repeat_kv))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_planners_bytes_per_layer_are_what_the_model_saves(checkpointing):
    measured = {s: measured_per_layer(s, checkpointing) for s in SEQS}
    for s, m in measured.items():
        assert modelled(s, checkpointing, repeat_kv=False) == pytest.approx(m, rel=CPU_TOLERANCE), s
        assert modelled(s, checkpointing, repeat_kv=True) == pytest.approx(m, rel=TOLERANCE), s
    # and they grow with the sequence as measured: linearly (no s x s matrix is kept)
    for s in SEQS[1:]:
        assert measured[s] / measured[SEQS[0]] == pytest.approx(s / SEQS[0], rel=0.01)
        assert modelled(s, checkpointing, True) / modelled(SEQS[0], checkpointing, True) == \
            pytest.approx(measured[s] / measured[SEQS[0]], rel=0.01)


def test_checkpointing_keeps_only_each_blocks_input():
    for s in SEQS:
        assert measured_per_layer(s, True) == BATCH * s * TINY["hidden_size"] * 4   # fp32
        assert measured_per_layer(s, True) < measured_per_layer(s, False) / 10


def test_the_loss_keeps_fp32_log_probabilities_over_the_vocabulary():
    """The final norm, the LM head's input and the loss's log-softmax: a 0-layer model's forward."""
    facts = ModelConfig(num_layers=4, **TINY).facts()
    for s in SEQS:
        measured = saved_bytes(0, s, False, loss=True)
        assert logits_bytes(facts, ActivationShape(s, BATCH, 4)) == pytest.approx(measured, rel=TOLERANCE)
