"""A training checkpoint from elsewhere (downloaded, on a volume others can write) opened as a model:
its DCP `.metadata` is a pickle, and one built to run code is refused with one line naming the file,
the code never running; a normal checkpoint still opens and reads."""
from __future__ import annotations

import enum
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.worker.errors import WorkerError
from shardwise.worker.model.llama import Transformer
from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import checkpoint_tiers as tiers
from shardwise.worker.weights.formats import open_model
from shardwise.worker.weights.tiny import write_tiny_model


class _RunsCode:
    """Unpickled, it calls os.system: what a hostile `.metadata` would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A committed training checkpoint of the tiny model, written through the trainer's own tier."""
    base = write_tiny_model(tmp_path_factory.mktemp("base"), "the quick brown fox jumps over a lazy dog " * 40,
                            layers=2)
    config = open_model(str(base)).config
    state = Transformer(config).state_dict()
    root = tmp_path_factory.mktemp("ckpt")
    files = {name: (base / name).read_bytes() for name in ckpt.MODEL_FILES if (base / name).is_file()}
    manager = tiers.CheckpointManager(root, rank=0, group=None, model_meta={}, asynchronous=False, files=files)
    manager.save(1, {f"model/{k}": ckpt.Slice.whole(v) for k, v in state.items()},
                 {"model_config": config.to_dict()})
    manager.wait()
    return root / ckpt.step_dir_name(1), state


def _hostile_copy(folder: Path, dest: Path, metadata: bytes) -> Path:
    """A copy of `folder` with `metadata` as its `.metadata`, the COMPLETE marker made to match
    (whoever wrote the folder wrote the marker too)."""
    copy = dest / folder.name
    copy.mkdir(parents=True)
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / ".metadata").write_bytes(metadata)
    marker = json.loads((copy / ckpt.MARKER).read_text())
    marker["files"][".metadata"] = len(metadata)
    (copy / ckpt.MARKER).write_text(json.dumps(marker))
    return copy


def test_a_normal_checkpoint_still_opens_as_a_model(checkpoint):
    folder, state = checkpoint
    source = open_model(str(folder))
    assert torch.equal(source.read("norm.weight", None), state["norm.weight"])
    assert ckpt.stored_shapes(folder)["model/tok_embeddings.weight"] == tuple(state["tok_embeddings.weight"].shape)


def test_metadata_that_would_run_code_is_refused_in_one_line(checkpoint, tmp_path):
    folder, _ = checkpoint
    marker = tmp_path / "code-ran"
    hostile = _hostile_copy(folder, tmp_path / "downloaded", pickle.dumps(_RunsCode(marker)))
    # The command a user runs on a downloaded folder: one line, no traceback, nothing executed.
    p = subprocess.run([sys.executable, "-m", "shardwise", "generate", "--model", str(hostile), "--prompt", "x",
                        "--max-new-tokens", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert str(hostile / ".metadata") in lines[0] and "refused" in lines[0]
    assert not marker.exists()
    # Every reading path in process too: the shapes, the slices, a resume of the run's directory.
    with pytest.raises(WorkerError, match="refused"):
        open_model(str(hostile))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: refused to load, it names posix\.system"):
        ckpt.stored_shapes(hostile)
    with pytest.raises(ckpt.CheckpointError, match="refused"):
        ckpt.read_slices(hostile, {"model/norm.weight": ckpt.Slice.whole(torch.zeros(64))})
    with pytest.warns(UserWarning, match="refused"):
        assert tiers.CheckpointManager(hostile.parent, rank=0, group=None, model_meta={}).load_latest(
            {"model/norm.weight": ckpt.Slice.whole(torch.zeros(64))}) is None
    assert not marker.exists()


def test_metadata_naming_files_outside_its_folder_is_refused(checkpoint, tmp_path):
    folder, _ = checkpoint
    good = (folder / ".metadata").read_bytes()
    name = b"__0_0.distcp"
    assert name in good
    hostile = _hostile_copy(folder, tmp_path / "downloaded", good.replace(name, b"../../etc/pa"))  # same length
    with pytest.raises(ckpt.CheckpointError, match=r"names '\.\./\.\./etc/pa', not a plain data file"):
        ckpt.stored_shapes(hostile)


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as getattr(their class, their name), as some Python builds do."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickled(metadata: bytes) -> bytes:
    out = io.BytesIO()
    _EnumsByGetattr(out).dump(pickle.loads(metadata))
    return out.getvalue()


def test_enum_members_stored_by_getattr_load_and_no_other_getattr_does(checkpoint, tmp_path):
    folder, state = checkpoint
    as_getattr = _repickled((folder / ".metadata").read_bytes())
    assert b"getattr" in as_getattr
    copy = _hostile_copy(folder, tmp_path / "other-python", as_getattr)
    assert ckpt.stored_shapes(copy)["model/norm.weight"] == tuple(state["norm.weight"].shape)
    norm = ckpt.Slice.whole(torch.zeros_like(state["norm.weight"]))
    ckpt.read_slices(copy, {"model/norm.weight": norm})
    assert torch.equal(norm.tensor, state["norm.weight"])
    # getattr reaching past an enum member (here to a class's method) is refused
    class Reach:
        def __reduce__(self):
            return getattr, (torch.Size, "__class__")
    hostile = _hostile_copy(folder, tmp_path / "reach", pickle.dumps(Reach()))
    with pytest.raises(ckpt.CheckpointError, match="getattr on something other than an enum member"):
        ckpt.stored_shapes(hostile)
