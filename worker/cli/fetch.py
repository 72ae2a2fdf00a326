"""`shardwise fetch`: fetch a model (or one pipeline stage's share of it) from where it lives into a
node-local cache folder, with a progress line, and say what was downloaded and what was reused.
A stage's share is its files of a safetensors model, or its byte ranges of a GGUF file (the header
and its tensors, kept in a partial file: worker/fetch/gguf_fill.py); the counts are of those bytes."""
from __future__ import annotations

import argparse
import json
import sys
import time

from shardwise.crds.cli.inspect import add_store_arguments
from shardwise.worker.fetch.remote import MAX_STREAMS
from shardwise.worker.fetch.streams import MIN_PART_BYTES, STREAMS

GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", help="the model: s3://bucket/prefix, hf://org/name[@revision], "
                        "oci://registry/repository:tag")
    parser.add_argument("--cache", required=True, help="the cache's root folder (created if missing)")
    parser.add_argument("--budget-gib", type=float, default=500.0,
                        help="bytes all cached models may hold together; least recently used go first")
    add_store_arguments(parser)
    parser.add_argument("--stage", type=int, default=0,
                        help="fetch only this pipeline stage's share (its files; of a GGUF model, its byte ranges)")
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline stages of the layout")
    parser.add_argument("--layers", default=None, metavar="FIRST:END",
                        help="the stage's layers [FIRST, END) as its plan gives them (default: the "
                        "planner's split of the model into --pipeline stages)")
    parser.add_argument("--streams", type=int, default=STREAMS,
                        help=f"reads in flight at once: several files, and a large file in byte-range parts "
                        f"of at least {MIN_PART_BYTES >> 20} MiB (1 to {MAX_STREAMS}; 1: one file after "
                        f"another, one stream each)")
    parser.add_argument("--min-part-mib", type=float, default=MIN_PART_BYTES / 2**20,
                        help="split a file into byte-range parts of at least this many MiB; a download "
                        "cut short keeps its parts (recorded as each is written) and the next run "
                        "resumes from them")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args) -> int:
    from shardwise.crds.modelsource import ModelUriError
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.fetch.remote import RemoteError
    try:
        return _run(args)
    except (WorkerError, RemoteError, ModelUriError) as e:
        print(f"shardwise fetch: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from pathlib import Path

    from shardwise.crds.modelsource import parse_model_uri
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.fetch.cache import CacheConfig, ModelCache, reused_words
    from shardwise.worker.fetch.pull import fetch_stage
    from shardwise.worker.fetch.stores import open_remote, options_from_args

    parsed = parse_model_uri(args.uri)
    if args.budget_gib <= 0 or not 1 <= args.pipeline <= 4096 or not 1 <= args.streams <= MAX_STREAMS:
        raise WorkerError(f"--budget-gib must be positive, --pipeline between 1 and 4096 and --streams "
                          f"between 1 and {MAX_STREAMS}")
    if not 1 / 16 <= args.min_part_mib <= 1 << 20:
        raise WorkerError("--min-part-mib must be between 0.0625 and 1048576")
    layers = _layers(args.layers)
    remote = open_remote(parsed, options_from_args(args))
    cache = ModelCache(CacheConfig(Path(args.cache), int(args.budget_gib * GIB), streams=args.streams,
                                   min_part_bytes=int(args.min_part_mib * 2**20)),
                       on_retry=lambda why: print(f"\nshardwise fetch: retrying: {why}", file=sys.stderr))
    start = time.monotonic()
    report = fetch_stage(cache, remote, parsed.scheme.value, parsed.location, args.stage, args.pipeline,
                         layers, progress=_progress_line())
    took = time.monotonic() - start
    print(file=sys.stderr)
    result = {"uri": str(parsed), "files_dir": str(report.files_dir), "files": len(report.files),
              "fetched_bytes": report.fetched_bytes, "reused_bytes": report.reused_bytes,
              "resumed_bytes": report.resumed_bytes,
              "seconds": round(took, 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{parsed}: {len(report.files)} files in {report.files_dir}: fetched "
              f"{report.fetched_bytes / 2**20:.1f} MiB, {reused_words(report)} in {took:.1f}s")
    return 0


def _layers(value: str | None) -> tuple[int, int] | None:
    """--layers FIRST:END as a range; WorkerError (one line) when it is not one."""
    from shardwise.worker.errors import WorkerError
    if value is None:
        return None
    first, _, end = value.partition(":")
    if not (first.isdigit() and end.isdigit() and int(first) < int(end) <= 1_000_000):
        raise WorkerError(f"--layers must be FIRST:END with FIRST < END (such as 0:40), not {value[:40]!r}")
    return int(first), int(end)


def _progress_line():
    """A callback printing 'fetched X of Y MiB (Z%)' over itself, at most 4 times a second."""
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.25 and done < total:
            return
        last[0] = now
        pct = 100.0 * done / total if total else 100.0
        print(f"\rfetched {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({pct:.0f}%)", end="",
              file=sys.stderr, flush=True)
    return show
