"""`shardwise inspect hf://... | s3://... | oci://...`: a remote model's shape, read from its store.

The command is crds/cli/inspect.py's (the same options and output); the CLI hands a MODEL that names
a store here, since only the worker reads stores. What is read is bounded and small: config.json
(the stored size is the listing's safetensors bytes), or a GGUF file's header by byte ranges, the
rest of the file never travelling. The credentials are the environment's (crds/names.py
CREDENTIAL_ENV), as a pod gets them from its spec's Secret. Errors are one line and exit status 2,
or crds/names.py EXIT_UNREACHABLE (75) when the store could not be reached or was busy (asking again
later may succeed: the operator's probe does).

The bytes read here are not checksummed (only the cache checks files, cache.py): config.json is
parsed with bounds and the facts are checked against MODEL_FACT_LIMITS by the operator, and a pod
compares the plan's layer count with the files it loads.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# config.json is a few KiB; a longer one is not a model's config.
MAX_CONFIG_BYTES = 4 << 20
# A GGUF header (its metadata, the tokenizer's vocabulary, the tensor table) is read in growing
# byte ranges up to this: a 150k-token vocabulary is a few MiB.
GGUF_HEADER_STEPS = (1 << 20, 16 << 20, 128 << 20)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shardwise.crds.cli import inspect
    inspect.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from shardwise.crds import names
    from shardwise.crds.cli.inspect import describe, write_output
    from shardwise.crds.modelshape import ModelFactsError, in_memory_dtype
    from shardwise.crds.modelsource import ModelUriError
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.fetch.remote import RemoteError, Unreachable
    from shardwise.worker.fetch.stores import options_from_args
    try:
        facts = remote_facts(args.model, args.dtype, options_from_args(args))
        document = json.dumps(facts.to_dict())
        if args.output:
            write_output(args.output, document)
    except (ModelFactsError, ModelUriError, RemoteError, WorkerError) as e:
        print(f"shardwise inspect: {e}", file=sys.stderr)
        return names.EXIT_UNREACHABLE if isinstance(e, Unreachable) else 2
    print(document if args.json else describe(facts, in_memory_dtype(args.dtype, facts.dtype, "cuda")))
    return 0


def remote_facts(uri: str, dtype: str = "auto", options=None):
    """The ModelFacts of a remote model, from its config.json or its GGUF header."""
    from shardwise.crds.modelsource import parse_model_uri
    from shardwise.worker.fetch.stores import SourceOptions, open_remote

    parsed = parse_model_uri(uri)
    remote = open_remote(parsed, options or SourceOptions())
    listing = {f.name: f for f in remote.list_files()}
    ggufs = [f for name, f in listing.items() if name.endswith(".gguf")]
    with tempfile.TemporaryDirectory(prefix="shardwise-inspect-") as tmp:
        if "config.json" in listing:
            return _from_config(remote, listing, Path(tmp), dtype, str(parsed))
        if len(ggufs) == 1:
            return _from_gguf_header(remote, ggufs[0], Path(tmp), dtype, str(parsed))
    from shardwise.crds.modelshape import ModelFactsError
    what = f"{len(ggufs)} .gguf files (name one in the uri)" if ggufs else "no config.json and no .gguf file"
    raise ModelFactsError(f"{parsed}: {what}")


def _read(remote, name: str, start: int, end: int) -> bytes:
    out = bytearray()
    for chunk in remote.read(name, start, end):
        out += chunk
        if len(out) > end - start:
            from shardwise.worker.fetch.remote import RemoteError
            raise RemoteError(f"{remote.describe()}: the store sent more of {name} than was asked")
    return bytes(out)


def _from_config(remote, listing, tmp: Path, dtype: str, source: str):
    from shardwise.crds.modelshape import ModelFactsError, from_hf_dir
    config = listing["config.json"]
    if config.size > MAX_CONFIG_BYTES:
        raise ModelFactsError(f"{source}: config.json is {config.size} bytes, more than a model's config")
    (tmp / "config.json").write_bytes(_read(remote, "config.json", 0, config.size))
    facts = from_hf_dir(tmp, dtype)
    stored = sum(f.size for name, f in listing.items() if name.endswith(".safetensors"))
    return replace(facts, source=source, **({"file_bytes": stored} if stored else {}))


def _from_gguf_header(remote, gguf, tmp: Path, dtype: str, source: str):
    """The header's bytes in a sparse file as long as the remote one (so the tensor table's extents
    are checked against the real size), read in growing ranges until the header parses."""
    from shardwise.crds.modelshape import ModelFactsError, from_gguf
    path = tmp / "model.gguf"
    have = 0
    with open(path, "wb") as f:
        f.truncate(gguf.size)
    for step in GGUF_HEADER_STEPS:
        end = min(step, gguf.size)
        with open(path, "r+b") as f:
            f.seek(have)
            f.write(_read(remote, gguf.name, have, end))
        have = end
        try:
            return replace(from_gguf(path, dtype, limit=have), source=f"{source} ({gguf.name})")
        except ModelFactsError:
            if have >= gguf.size or step == GGUF_HEADER_STEPS[-1]:
                raise
    raise AssertionError("unreachable")
