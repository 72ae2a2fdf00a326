"""Error-feedback residuals in checkpoints: what compression has not sent yet survives a restart.

Each replicate group keeps its own residuals (what its ranks dropped from their contributions), so
a checkpoint holds one set per group, `compression/residual/<group>/<parameter name>`, each as
slices of the full parameter shape like the parameters themselves: a resume with another tensor,
pipeline or shard split reads its own part of them (the slices are resharded by DCP's load).

A resume with the same number of replicate groups gives every group its own residuals back, so the
run continues with the losses of a run that was never interrupted. With another number of groups
no group's own residual exists; every new group starts from the mean of the saved ones, which keeps
what is still owed to the average gradient (the mean over groups of their residuals) the same. A
checkpoint without residuals (saved uncompressed, or before they were checkpointed) starts them at
zero: a few steps' worth of dropped gradient, not the model, is lost.

PowerSGD's warm-start bases (Q, powersgd.py) are the same on every replicate group (they are
averaged), but each belongs to one rank's shard of its gradient: `compression/powersgd-q/<parameter
name>/<shard>`, the shard named by its offsets and shape in the full parameter, saved whole (the
ranks of other replicate groups holding the same shard write the same tensor, which DCP keeps once).
A resume with the same tensor and shard layout and rank reads them back, whatever the number of
replicate groups; otherwise a shard's basis does not fit the new shards' matrices, and the bases
restart from their seeded initial values (the power iteration finds the directions again within a
few steps; the log says so).
"""
from __future__ import annotations


import torch

from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import parallelize as par

PREFIX = "compression/residual/"
BASES = "compression/powersgd-q/"


def residual_slices(compressor, params, names: dict[int, str], group: int) -> dict[str, ckpt.Slice]:
    """The residual of each of `params` (their compressor positions) as a slice of its parameter's
    full shape, named for replicate group `group`; `names` maps id(parameter) to its name."""
    regions = [par.local_region(p) for p in params]
    residuals = compressor.residuals_for([local for local, _, _ in regions])
    return {f"{PREFIX}{group}/{names[id(p)]}": ckpt.Slice(r, full, offsets)
            for p, r, (_, full, offsets) in zip(params, residuals, regions)}


def _saved_groups(stored: dict) -> list[int]:
    groups = set()
    for key in stored:
        if key.startswith(PREFIX):
            head = key[len(PREFIX):].split("/", 1)[0]
            if head.isdigit():
                groups.add(int(head))
    return sorted(groups)


def _renamed(slices: dict[str, ckpt.Slice], group: int, other: int) -> dict[str, ckpt.Slice]:
    """Fresh tensors shaped as `slices`, under group `other`'s names."""
    mine, theirs = f"{PREFIX}{group}/", f"{PREFIX}{other}/"
    return {theirs + k[len(mine):]: ckpt.Slice(torch.empty_like(s.tensor), s.full_shape, s.offsets)
            for k, s in slices.items()}


def load_residuals(store, step: int, slices: dict[str, ckpt.Slice], group: int, groups: int) -> str:
    """Fill `slices` (residual_slices' of replicate group `group` of `groups`) from the checkpoint
    of `step` in `store` (the shared tier: checkpoint.ClaimStore or checkpoint_s3's); returns how
    (one line, for the log)."""
    stored = store.shapes(step)
    saved = _saved_groups(stored)
    present = {k: s for k, s in slices.items() if k in stored}
    if not saved or not present:
        return "the checkpoint holds no compression residuals: they start at zero"
    if saved == list(range(groups)):
        store.read(step, present)
        return f"compression residuals of {groups} replicate groups resumed"
    total = {k: torch.zeros_like(s.tensor) for k, s in present.items()}
    for other in saved:
        theirs = _renamed(present, group, other)
        store.read(step, theirs)
        for (k, _), s in zip(present.items(), theirs.values()):
            total[k] += s.tensor
    with torch.no_grad():
        for k, s in present.items():
            s.tensor.copy_(total[k] / len(saved))
    return (f"compression residuals saved by {len(saved)} replicate groups, resumed by {groups}: "
            f"each starts from their mean")


def basis_slices(compressor, params, names: dict[int, str]) -> dict[str, ckpt.Slice]:
    """powersgd's warm-start Q of each of `params` that is compressed as a matrix, each saved whole
    under its parameter's name and this rank's shard of it; {} for the other methods."""
    regions = [par.local_region(p) for p in params]
    bases = compressor.bases_for([local for local, _, _ in regions])
    out = {}
    for i, q in bases.items():
        local, _, offsets = regions[i]
        shard = "at-" + "-".join(map(str, offsets)) + "-size-" + "x".join(map(str, local.shape))
        out[f"{BASES}{names[id(params[i])]}/{shard}"] = ckpt.Slice(q, tuple(q.shape), (0,) * q.dim())
    return out


def load_bases(store, step: int, slices: dict[str, ckpt.Slice]) -> str | None:
    """Fill `slices` (basis_slices') from the checkpoint of `step` where it holds a basis of the
    same shard and shape; the others keep their seeded initial values. Returns how (one line, for
    the log), or None when there are no bases to resume."""
    if not slices:
        return None
    stored = store.shapes(step)
    present = {k: s for k, s in slices.items() if tuple(stored.get(k, ())) == tuple(s.tensor.shape)}
    if present:
        store.read(step, present)
    if len(present) == len(slices):
        return "PowerSGD bases resumed"
    if not any(k.startswith(BASES) for k in stored):
        why = "the checkpoint holds none"
    else:
        why = "they were saved for another split of the gradients (tensor or shard layout) or another rank"
    return (f"PowerSGD bases of {len(slices) - len(present)} of {len(slices)} gradient matrices restart "
            f"from their initial values: {why}")
