"""How the model's matrices split under tensor parallelism (Megatron's layout): the one table
that inference's splits (distributed/tensor_parallel.py) and training's DTensor plan
(training/parallelize.py) are both derived from.

Per decoder layer, one all-reduce per sub-layer: the inputs of a sub-layer stay replicated, its
first matrices are split by output (COLUMN: attention heads, MLP columns), its last by input
(ROW: partial sums, joined by the all-reduce). The token embedding and the LM head split along
the vocabulary (VOCAB): each rank looks up or scores the ids it owns. A mixture of experts splits
its stacked experts over the group instead (moe.py); its shared expert splits like a dense MLP.
"""
from __future__ import annotations

from enum import Enum


class Split(str, Enum):
    COLUMN = "column"       # rows of the [out, in] weight: each rank computes some outputs
    ROW = "row"             # columns of the [out, in] weight: each rank a partial sum of all outputs
    VOCAB = "vocab"         # rows of the vocabulary (embedding table, LM head), padded to the degree


# By parameter module name inside Attention and FeedForward (llama.py).
ATTENTION_SPLITS = {"wq": Split.COLUMN, "wk": Split.COLUMN, "wv": Split.COLUMN, "wo": Split.ROW}
FEED_FORWARD_SPLITS = {"w1": Split.COLUMN, "w3": Split.COLUMN, "w2": Split.ROW}   # gate, up, down

# By module name inside a TransformerBlock (a dense one).
BLOCK_SPLITS = {**{f"attention.{k}": v for k, v in ATTENTION_SPLITS.items()},
                **{f"feed_forward.{k}": v for k, v in FEED_FORWARD_SPLITS.items()}}

# By module name inside a Transformer: the ends of the model.
VOCAB_SPLITS = {"tok_embeddings": Split.VOCAB, "output": Split.VOCAB}
