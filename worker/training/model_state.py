"""This rank's part of the model for training: each pipeline stage built on the meta device,
split and wrapped, then filled with only this rank's shards; its parameters and AdamW state as
slices of the full tensors (what a checkpoint stores); and the model files a checkpoint carries."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardwise.crds.training import Precision
from shardwise.worker.errors import WorkerError
from shardwise.worker.model.llama import Transformer
from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import parallelize as par
from shardwise.worker.training.context_parallel import apply_context_parallel
from shardwise.worker.training.options import TrainOptions


def _full_name(model, name: str) -> str:
    # A tied head on the last stage (pipeline > 1) is a copy of the embedding: store it once.
    if name == "output.weight" and model.config.tie_word_embeddings:
        return "tok_embeddings.weight"
    return name


def _slice(t: torch.Tensor) -> ckpt.Slice:
    local, full, offsets = par.local_region(t)
    return ckpt.Slice(local, full, offsets)


def param_slices(model, prefix: str = "model/") -> dict[str, ckpt.Slice]:
    """This rank's parameters as slices of the full tensors, named by full (unsharded) names."""
    return {prefix + _full_name(model, name): _slice(p) for name, p in model.named_parameters()}


def optimizer_slices(model, optimizer) -> dict[str, ckpt.Slice]:
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        key = "optim/" + _full_name(model, name)
        out[key + "/exp_avg"] = _slice(state["exp_avg"])
        out[key + "/exp_avg_sq"] = _slice(state["exp_avg_sq"])
        out[key + "/step"] = ckpt.Slice.whole(state["step"])
    return out


def init_optimizer_state(params, optimizer) -> None:
    """Create AdamW's state up front so a checkpoint can be loaded into it in place."""
    for p in params:
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


# ---------------------------------------------------------------- building this rank's stages

def build_stage(source, start: int, end: int, first: bool, last: bool, mesh, opts: TrainOptions,
                device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """One pipeline stage of the model: built on the meta device, split (TP), wrapped (activation
    checkpointing, FSDP2), then materialized with only this rank's shards read from the model."""
    with torch.device("meta"):
        model = Transformer(source.config, start, end, first, last)
    if opts.precision == Precision.FP8:   # torchtitan's order: float8 first, then TP, AC, FSDP
        par.apply_float8(model, fsdp_all_gather=par.sharding_mesh(mesh, replicate=False).size() > 1)
    par.apply_tensor_parallel(model, mesh["tp"], opts.sequence_parallel)
    apply_context_parallel(model, mesh["cp"])
    if opts.activation_checkpointing:
        par.apply_activation_checkpointing(model)
    compressed = opts.compression != "none" and opts.mesh_shape.replicate > 1
    dp_mesh = par.sharding_mesh(mesh, replicate=not compressed)
    # With several micro-batches per step, keep a stage's parameters gathered between them.
    par.apply_fsdp(model, dp_mesh, compute_dtype, reshard_after_forward=opts.pipeline == 1,
                   prefetch=opts.prefetch_depth)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local, full_shape, offsets = par.local_region(p)
            full = source.read(name, None)
            if tuple(full.shape) != full_shape:
                raise WorkerError(f"{source.path}: tensor for {name} has shape {tuple(full.shape)}, "
                                  f"expected {full_shape}")
            for dim, (off, size) in enumerate(zip(offsets, local.shape)):
                full = full.narrow(dim, off, size)
            local.copy_(full)
    return model.train()


def model_files(source, tokenizer) -> dict[str, bytes]:
    """Config and tokenizer files a checkpoint carries, so that it serves as a model by itself.

    From an HF folder (or an earlier checkpoint) they are copied; a GGUF model's tokenizer, built
    from the GGUF metadata, is written out as tokenizer.json."""
    files = {}
    folder = Path(source.path)
    if folder.is_dir():
        for name in ckpt.MODEL_FILES:
            if (folder / name).is_file():
                files[name] = (folder / name).read_bytes()
    if "tokenizer.json" not in files and hasattr(tokenizer, "tok"):
        files["tokenizer.json"] = tokenizer.tok.to_str().encode()
    return files
