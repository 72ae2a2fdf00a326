"""`shardwise inspect MODEL`: a model's shape and its size in GPU memory, as the planner sees them.

Needs neither torch nor kopf: a probe pod runs it in whichever image it has,

    shardwise inspect /models/<claim>/<path> --json --output /dev/termination-log

and the operator reads the pod's termination message back with ModelFacts.from_dict. Bad input
(no such path, not a model, a damaged GGUF) is one line on stderr and exit status 2.

A MODEL that names a store (hf://, s3://, oci://) is read by the worker's command of the same name
(worker/cli/inspect.py, the `shardwise` CLI routes it there): only the worker reads stores.
"""
from __future__ import annotations

import argparse
import json
import sys

from shardwise.crds.modelshape import (COMPUTE_DTYPES, DTYPE_BYTES, ModelFacts, ModelFactsError, from_path,
                                       in_memory_dtype, local_path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a .gguf file, an HF model directory or its "
                        "config.json; or hf://, s3://, oci:// (read from the store, in the worker image)")
    parser.add_argument("--dtype", choices=["auto", *COMPUTE_DTYPES], default="auto",
                        help="the dtype asked for, as spec.dtype (auto: the model's own on a GPU, "
                             "bfloat16 for a quantized GGUF or when unknown)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the model facts)")
    parser.add_argument("--output", metavar="FILE", help="also write that JSON object to FILE")
    add_store_arguments(parser)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """A remote model's store options, as `shardwise inspect` and `shardwise fetch` take them (the
    operator passes them to its probe and pre-pull pods, operator/render/source.py store_options):
    an s3:// model's spec.model.endpoint, region and pathStyle, and plain HTTP to an oci:// registry.
    Credentials only from the environment (crds/names.py CREDENTIAL_ENV), never as arguments
    (visible in the pod's spec)."""
    parser.add_argument("--endpoint", metavar="URL", help="s3://: the S3-compatible endpoint (default: AWS)")
    parser.add_argument("--region", help="s3://: the bucket's region (default: us-east-1)")
    parser.add_argument("--path-style", action="store_true",
                        help="s3://: address the bucket in the path (MinIO and most on-premises stores)")
    parser.add_argument("--plain-http", action="store_true",
                        help="oci://: speak HTTP, not HTTPS, to the registry (always so to one on this "
                             "machine); its credentials then cross the network in clear")


def run(args: argparse.Namespace) -> int:
    try:
        path = local_path(args.model)
        if path is None:
            raise ModelFactsError(f"{args.model}: no such file or directory")
        facts = from_path(path, args.dtype)
        document = json.dumps(facts.to_dict())
        if args.output:
            write_output(args.output, document)
    except ModelFactsError as e:
        print(f"shardwise inspect: {e}", file=sys.stderr)
        return 2
    print(document if args.json else describe(facts, in_memory_dtype(args.dtype, facts.dtype, "cuda")))
    return 0


def write_output(path: str, document: str) -> None:
    try:
        with open(path, "w") as f:   # opened, not replaced: /dev/termination-log is a mounted file
            f.write(document)
    except OSError as e:
        raise ModelFactsError(f"cannot write {path}: {e.strerror or e}") from None


def describe(facts: ModelFacts, dtype: str) -> str:
    """The facts as a few aligned lines for a person."""
    mib = 2**20
    stored = facts.dtype or "unknown dtype"
    if facts.file_bytes:
        stored += f", {facts.file_bytes / mib:.1f} MiB"
    rows = [("model", facts.source),
            ("layers", str(facts.layers)),
            ("heads", f"{facts.heads} ({facts.kv_heads} KV heads, head dim {facts.head_dim})"),
            ("hidden", str(facts.hidden)),
            ("intermediate", str(facts.intermediate)),
            ("vocab", str(facts.vocab)),
            ("parameters", f"{facts.params:,}" + (" (tied embeddings)" if facts.tied_embeddings else "")),
            ("stored", stored),
            ("in memory", f"{facts.weight_bytes / mib:.1f} MiB on a GPU as {dtype} "
                          f"({DTYPE_BYTES[dtype]} bytes per parameter)")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
