"""The loading of one rank's share of a model.

A rank opens its model (formats.open_model), builds its stage on the meta device, applies tensor
parallelism (which records how each parameter is split) and then reads only its slices from the
source: sliced safetensors reads, a GGUF file's rows, a checkpoint's DCP chunks. Its memory is
about its share. A rank's code imports what it needs from here: open_model and resolve_model too.
"""
from __future__ import annotations

import torch
from torch import nn

from shardwise.crds.modelshape import COMPUTE_DTYPES

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.inference import FUSED_MATRICES
from shardwise.worker.model.llama import ModelConfig, Transformer
from shardwise.worker.distributed.tensor_parallel import (VocabParallelEmbedding, VocabParallelHead,
                                                          apply_tensor_parallel, check_tensor_parallel)
from shardwise.worker.weights.builtin import builtin_model_path, resolve_model
from shardwise.worker.weights.formats import open_model
from shardwise.worker.weights.source import ModelSource

__all__ = ["DTYPES", "builtin_model_path", "check_layout", "check_stage", "load_stage", "open_model",
           "resolve_model"]


def check_layout(config: ModelConfig, tensor: int, pipeline: int) -> None:
    try:
        check_tensor_parallel(config, tensor)
    except ValueError as e:
        raise WorkerError(str(e)) from None
    if pipeline < 1 or pipeline > config.num_layers:
        raise WorkerError(f"pipeline parallel degree {pipeline} is more stages than the model's "
                          f"{config.num_layers} layers (use 1..{config.num_layers})")


DTYPES = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


# The embedding and head modules whose weights can be kept as blocks (quantize._build_vocab_blocks
# builds each kind): a whole table, or a rank's vocabulary slice under tensor parallelism.
_VOCAB_MODULES = (nn.Embedding, nn.Linear, VocabParallelEmbedding, VocabParallelHead)


def _read_blocks(source: ModelSource, model: Transformer, shards: dict) -> tuple[dict, set[str]]:
    """({'layers.3.attention.wqkv': Blocks, ...}, the parameter names they stand for): each fused
    matrix of this rank's layers whose parts all come in one fast-path type (see load_stage)."""
    from shardwise.worker.weights.gguf_blocks import Blocks
    read = getattr(source, "read_blocks", None)
    blocks: dict = {}
    kept: set[str] = set()
    for i in model.layers:
        for fused, parts in FUSED_MATRICES.items():
            names = [f"layers.{i}.{part}.weight" for part in parts]
            got = [read(name, shards.get(name)) for name in names] if read else [None]
            if all(b is not None for b in got) and len({b.qtype for b in got}) == 1:
                blocks[f"layers.{i}.{fused}"] = Blocks.concat(got)
                kept.update(names)
    # The embedding and the LM head (one matrix when tied): whole, or under tensor parallelism the
    # rank's vocabulary slice of rows (tensor_parallel._split_vocab), zero rows for the padding.
    for name, module in (("tok_embeddings", model.tok_embeddings), ("output", model.output)):
        weight = getattr(module, "weight", None)
        if not read or type(module) not in _VOCAB_MODULES or name + ".weight" in kept:
            continue
        got = read(name + ".weight", shards.get(name + ".weight"))
        if got is not None:
            names = {n for n, p in model.named_parameters(remove_duplicate=False) if p is weight}
            blocks.update({n.rpartition(".")[0]: got for n in names})    # tied: both keys, one Blocks
            kept.update(names)
    return blocks, kept


def check_stage(source: ModelSource, layer_start: int, layer_end: int, embedding: bool, head: bool) -> None:
    """WorkerError (one line) if a weight the stage loads is not at hand: a file of a sharded HF
    model that a stage fetched alone lacks because only another stage reads it is no error; one
    that this stage reads is, said before its ranks start rather than when it reads it."""
    with torch.device("meta"):
        model = Transformer(source.config, layer_start, layer_end, embedding, head)
    source.require(name for name, _ in model.named_parameters())


def load_stage(source: ModelSource, layer_start: int, layer_end: int, embedding: bool, head: bool,
               tp_rank: int = 0, tp_world: int = 1, group=None, device="cpu",
               dtype: torch.dtype = torch.float32, keep_blocks: bool = False) -> Transformer:
    """Build this rank's part of the model and fill it with only its slices of the weights.

    keep_blocks (`--quantize gguf`): the decoder-layer matrices that a GGUF file stores in a type
    with a fast path are not read as floats: their blocks go to `model.gguf_blocks` by fused name
    (inference.FUSED_MATRICES), the parameters stay on the meta device, and quantize.quantize_weights
    builds them after inference.install_fused_weights. A fused group is kept only if all its parts are.
    The embedding and the LM head are kept likewise, whole or (tensor parallelism) their vocabulary
    slice of rows."""
    with torch.device("meta"):
        model = Transformer(source.config, layer_start, layer_end, embedding, head)
    apply_tensor_parallel(model, tp_rank, tp_world, group)
    shards = model.tp_shards
    model.gguf_blocks, kept = _read_blocks(source, model, shards) if keep_blocks else ({}, set())
    for name, param in list(model.named_parameters()):
        if name in kept:
            continue
        tensor = source.read(name, shards.get(name)).to(device=device, dtype=dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise WorkerError(f"{source.path}: tensor for {name} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    model.tie_weights()
    return model.eval()
