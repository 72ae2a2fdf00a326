"""Hostile .safetensors files: a header that is too long, nests without end, or whose entries do not
describe the file is one WorkerError line naming the file, refused before anything is mapped - and a
file the check accepts opens and reads with the `safetensors` library. The files are real files on
disk, built byte by byte, so each case is exactly the damage it names."""
from __future__ import annotations

import json
import os
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.cli import main
from shardwise.worker.errors import WorkerError
from shardwise.worker.weights.safetensors_header import HEADER_MAX_BYTES, tensor_names

TEXT = "one two three four five six seven eight nine ten. " * 30


def _file(header: object, data: bytes = b"", raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


VALID = {"__metadata__": {"format": "pt"},
         "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
         "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}


def _entry(**changes: object) -> dict:
    return {**VALID, "a": {**VALID["a"], **changes}}


def test_a_valid_file_gives_its_tensor_names(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_file(VALID, bytes(22)))
    assert tensor_names(str(path)) == ["a", "b"]


@pytest.mark.parametrize("name,content,says", [
    # old: RecursionError out of json.loads, a traceback
    ("deep", _file(None, raw=b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nests deeper than 3"),
    # old: AttributeError ('list' object has no attribute 'items')
    ("list", _file([1, 2]), "not a JSON object"),
    # old: TypeError / KeyError reading an entry
    ("entry", _file({"a": 5}), "entry of tensor 'a' is not an object"),
    ("nooffsets", _file({"a": {"dtype": "F32", "shape": [1]}}, bytes(4)), "data_offsets None"),
    # old: accepted; safetensors itself failed later, at load, with its own traceback
    ("dtype", _file(_entry(dtype="F99"), bytes(22)), "dtype 'F99'"),
    ("negative", _file(_entry(shape=[-2, -2]), bytes(22)), "not a list of at most 8 non-negative integers"),
    ("rank", _file(_entry(shape=[1] * 9, data_offsets=[0, 4]), bytes(22)), "at most 8"),
    ("bool", _file(_entry(shape=[True, 2]), bytes(22)), "non-negative integers"),
    ("size", _file(_entry(shape=[4, 4]), bytes(22)), "takes 64 bytes, its data_offsets span 16"),
    ("overlap", _file({**VALID, "b": {**VALID["b"], "data_offsets": [10, 16]}}, bytes(22)), "starts at data byte 10"),
    ("gap", _file(VALID, bytes(40)), "tensors take 22 bytes of data, the file has 40"),
    ("meta", _file({**VALID, "__metadata__": {"x": [1]}}, bytes(22)), "__metadata__"),
    ("cut", _file(VALID, bytes(10)), "is truncated"),
])
def test_hostile_header_is_one_line_naming_the_file(tmp_path, name, content, says):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(content)
    with pytest.raises(WorkerError) as e:
        tensor_names(str(path))
    message = str(e.value)
    assert str(path) in message and says in message and "\n" not in message, message


def test_a_header_as_large_as_the_file_is_refused_unread(tmp_path):
    """A 200 MB file whose header claims all of it: refused at its length (the format's 100 MB bound)
    at once, where it was read whole into memory and parsed."""
    path = tmp_path / "huge.safetensors"
    size = 200_000_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", size - 8) + b"{")
        f.truncate(size)      # sparse: costs no disk
    started = time.monotonic()
    with pytest.raises(WorkerError, match=f"claims {size - 8} bytes \\(at most {HEADER_MAX_BYTES}\\)"):
        tensor_names(str(path))
    assert time.monotonic() - started < 1


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    """A real file written by the safetensors library: two tensors and metadata."""
    import torch
    from safetensors.torch import save_file
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": torch.ones(5, dtype=torch.bfloat16)},
              str(path), metadata={"format": "pt"})
    return path.read_bytes()


@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6))
@settings(max_examples=500, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_files_are_refused_in_one_line_or_load(tmp_path, valid_file, edits):
    """Random bytes changed in a real file's header: WorkerError of one line naming the file, or a
    file that the safetensors library opens and reads every tensor of."""
    from safetensors import safe_open
    data = bytearray(valid_file)
    for at, value in edits:
        data[at % min(len(data), 8 + struct.unpack("<Q", valid_file[:8])[0])] = value
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(data))
    try:
        names = tensor_names(str(path))
    except WorkerError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(names)
        for name in names:
            f.get_tensor(name)


def test_generate_on_a_hostile_weight_file_is_one_line(capsys, tmp_path):
    """`shardwise generate` on a model directory whose weights' header nests without end: exit 2,
    one line naming the file, no traceback."""
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "m", TEXT, layers=2, hidden=32, heads=4, kv_heads=2)
    weights = model / "model.safetensors"
    weights.write_bytes(_file(None, raw=b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"))
    code = main(["generate", "--model", str(model), "--prompt", "one two", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and str(weights) in err and "nests deeper" in err
    assert os.path.getsize(weights) > 100_000


@pytest.mark.parametrize("file,content,says", [
    # old: RecursionError out of json.load, a traceback
    ("config.json", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 32"),
    ("generation_config.json", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 32"),
    # old: AttributeError ('list' object has no attribute 'get')
    ("generation_config.json", b"[1]", "is not a JSON object"),
    # old: AttributeError ('list' object has no attribute 'items')
    ("model.safetensors.index.json", b'{"weight_map": [1]}', "has no weight_map object"),
    # old: followed out of the model's directory
    ("model.safetensors.index.json", b'{"weight_map": {"lm_head.weight": "../../etc/passwd"}}',
     "'../../etc/passwd', not a file of"),
    # old: RecursionError out of json.load, a traceback
    ("tokenizer_config.json", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 32"),
    # old: a number taken for a template, failing later inside the template engine
    ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template is neither"),
    # old: the tokenizers library's bare Exception, a traceback
    ("tokenizer.json", b'{"x":', "is not a tokenizer this server can load"),
])
def test_hostile_json_of_a_model_directory_is_one_line(capsys, tmp_path, file, content, says):
    """config.json, generation_config.json, the tokenizer's files and the safetensors index are
    the download's too: one line naming the file from `shardwise generate`, exit 2, no traceback."""
    from shardwise.worker.weights.tiny import write_tiny_model
    model = write_tiny_model(tmp_path / "m", TEXT, layers=2, hidden=32, heads=4, kv_heads=2)
    (model / file).write_bytes(content)
    code = main(["generate", "--model", str(model), "--prompt", "one two", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and str(model / file) in err and says in err, err
