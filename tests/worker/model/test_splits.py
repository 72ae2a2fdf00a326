"""One table of Megatron's split (worker/model/splits.py): inference's tensor parallelism splits
each matrix by it, and training's DTensor plan is derived from it, so the two cannot disagree."""
from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.worker.distributed.tensor_parallel import apply_tensor_parallel
from shardwise.worker.model.llama import ModelConfig, Transformer
from shardwise.worker.model.splits import BLOCK_SPLITS, Split
from shardwise.worker.training.parallelize import BLOCK_TP_PLAN

CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
              num_kv_heads=2, tie_word_embeddings=True)


def test_training_plan_follows_the_table():
    assert set(BLOCK_TP_PLAN) == set(BLOCK_SPLITS)
    for name, split in BLOCK_SPLITS.items():
        want = ColwiseParallel if split is Split.COLUMN else RowwiseParallel
        assert type(BLOCK_TP_PLAN[name]) is want, name


def test_inference_splits_follow_the_table():
    with torch.device("meta"):
        model = Transformer(ModelConfig(**CONFIG))
    apply_tensor_parallel(model, 1, 2)
    for i in model.layers:
        for name, split in BLOCK_SPLITS.items():
            assert model.tp_shards[f"layers.{i}.{name}.weight"].dim == (0 if split is Split.COLUMN else 1)
    assert model.tp_shards["tok_embeddings.weight"].padded == 212
    wq = model.layers["0"].attention.wq.weight
    assert tuple(wq.shape) == (32, 64) and model.layers["0"].attention.n_heads == 4
