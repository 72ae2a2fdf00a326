"""Which of a model's files one pipeline stage needs, so each pod downloads only what it loads.

A stage loads its own layers, plus the embedding on the first stage and the final norm and LM head
on the last (a tied head is the embedding, so the last stage needs that too), by the one layer split
the planner and the worker use (crds/layout.py). Every rank of a stage's pod loads the same tensors
(each reads its tensor-parallel slice of them), so the stage is the unit of selection.

A sharded safetensors model says by `model.safetensors.index.json` which file holds each tensor: a
stage fetches config, tokenizer and generation config, then only the files that hold a tensor it
loads. A single `model.safetensors` is fetched whole. A `.gguf` file is the model's config too: a
stage's share comes from its header (`gguf_share`), and the byte ranges it reads from the header's
tensor table (`gguf_stage_ranges`), which the cache fetches into a partial file (gguf_fill.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardwise.crds.gguf import Header
from shardwise.crds.layout import split_layers
from shardwise.crds.modelshape import ModelFacts, ModelFactsError, from_gguf, from_hf_config
from shardwise.worker.errors import WorkerError
from shardwise.worker.fetch.remote import RemoteFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Everything a stage loads besides its weights (those the store has; none is required but config).
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "added_tokens.json", "chat_template.jinja", INDEX)
# The metadata a stage reads to decide is small; a store listing a bigger one is refused.
MAX_METADATA_BYTES = 64 << 20

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class StageShare:
    """What one stage of a `pipeline`-stage layout loads."""
    stage: int
    pipeline: int
    layers: tuple[int, int]          # [first, one past the last)
    tied: bool = False

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pipeline - 1

    def wants(self, name: str, layer: re.Pattern = _HF_LAYER,
              embedding: str = "model.embed_tokens.", head: tuple[str, ...] = ("model.norm.", "lm_head.")) -> bool:
        m = layer.match(name)
        if m:
            return self.layers[0] <= int(m.group(1)) < self.layers[1]
        if name.startswith(embedding):
            return self.first or (self.last and self.tied)
        if name.startswith(head):
            return self.last
        return True     # a tensor outside the known names: loaded by whoever asks, so fetched


def metadata_files(listing: list[RemoteFile]) -> list[RemoteFile]:
    """The listed files a stage reads before choosing weights; WorkerError without config.json."""
    chosen = [f for f in listing if f.name in METADATA_FILES]
    if not any(f.name == "config.json" for f in chosen):
        raise WorkerError("the model's store holds no config.json at its root")
    for f in chosen:
        if f.size > MAX_METADATA_BYTES:
            raise WorkerError(f"{f.name} is {f.size} bytes, more than {MAX_METADATA_BYTES} for metadata")
    return chosen


def stage_share(files_dir: Path, stage: int, pipeline: int,
                layers: tuple[int, int] | None = None) -> StageShare:
    """The stage's share by the model's config.json in `files_dir` (layers: the plan's, if it has them)."""
    try:
        config = json.loads((files_dir / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        facts = from_hf_config(config)
    except (OSError, ValueError, ModelFactsError) as e:
        raise WorkerError(f"config.json: {str(e).splitlines()[0][:200]}") from None
    return _share(facts, stage, pipeline, layers)


def gguf_share(path: Path, stage: int, pipeline: int, layers: tuple[int, int] | None = None) -> StageShare:
    """The stage's share by a GGUF file's header (in place at `path`, the tensors' data need not be)."""
    try:
        facts = from_gguf(path)
    except ModelFactsError as e:
        raise WorkerError(str(e).splitlines()[0][:300]) from None
    return _share(facts, stage, pipeline, layers)


def _share(facts: ModelFacts, stage: int, pipeline: int, layers: tuple[int, int] | None) -> StageShare:
    if not 0 <= stage < pipeline:
        raise WorkerError(f"stage {stage} is outside 0..{pipeline - 1}")
    if layers is None:
        try:
            layers = split_layers(facts, pipeline).ranges[stage]
        except ValueError as e:
            raise WorkerError(str(e)) from None
    return StageShare(stage, pipeline, layers, facts.tied_embeddings)


def whole_gguf(listing: list[RemoteFile]) -> RemoteFile | None:
    """The one .gguf file of a store that holds no config.json (a GGUF model: its header is its
    config), else None."""
    ggufs = [f for f in listing if f.name.endswith(".gguf") and "/" not in f.name]
    if len(ggufs) == 1 and not any(f.name == "config.json" for f in listing):
        return ggufs[0]
    return None


def weight_files(listing: list[RemoteFile], files_dir: Path, share: StageShare) -> list[RemoteFile]:
    """The safetensors files holding a tensor the stage loads (by the index in `files_dir`), or the
    single model.safetensors; WorkerError (one line) when the store has neither or the index is bad."""
    by_name = {f.name: f for f in listing}
    if INDEX not in by_name:
        if SINGLE in by_name:
            return [by_name[SINGLE]]
        raise WorkerError(f"the model's store holds neither {SINGLE} nor {INDEX}")
    try:
        weight_map = json.loads((files_dir / INDEX).read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise WorkerError(f"{INDEX}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(weight_map, dict):
        raise WorkerError(f"{INDEX} has no weight_map object")
    wanted: set[str] = set()
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or file in ("", ".", ".."):
            raise WorkerError(f"{INDEX}: tensor {str(tensor)[:80]!r} is in {str(file)[:80]!r}, "
                              "not a file of the model's folder")
        if share.wants(str(tensor)):
            wanted.add(file)
    missing = sorted(wanted - by_name.keys())
    if missing:
        raise WorkerError(f"{INDEX} names {missing[0]!r}, which the store does not hold")
    return [by_name[n] for n in sorted(wanted)]


def gguf_stage_ranges(header: Header, file_size: int, share: StageShare) -> list[tuple[int, int]]:
    """The byte ranges of a GGUF file a stage reads: its header (up to the first tensor's data) and
    its tensors' data (each up to the next tensor's start, padding included), adjacent ones merged."""
    tensors = sorted(header.tensors, key=lambda t: t.offset)
    if not tensors:
        return [(0, file_size)]
    spans = [(0, tensors[0].offset)]
    for t, nxt in zip(tensors, [*tensors[1:], None]):
        if share.wants(t.name, _GGUF_LAYER, "token_embd.", ("output_norm.", "output.")):
            spans.append((t.offset, nxt.offset if nxt else file_size))
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged
