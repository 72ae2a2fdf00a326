"""`shardwise push FOLDER oci://registry[:port]/repository:tag`: upload a model folder to a registry
as an OCI artifact that a ShardedModel's `model.uri: oci://...` reads (one layer per file, named by
its path; see worker/fetch/oci_push.py), and print the manifest digest to pin the uri to.

Credentials come from OCI_USERNAME and OCI_PASSWORD (or --username with the password on stdin),
never from the command line, and are never printed. Bad input is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="FOLDER", help="the model's folder (config.json, tokenizer, "
                        "*.safetensors and their index, or a .gguf)")
    parser.add_argument("target", metavar="oci://REGISTRY/REPOSITORY:TAG",
                        help="where to push it; the tag defaults to latest")
    parser.add_argument("--username", help="the registry user (default: $OCI_USERNAME); the password "
                        "is read from $OCI_PASSWORD, or from stdin with --password-stdin")
    parser.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    parser.add_argument("--plain-http", action="store_true",
                        help="talk HTTP, not HTTPS (a registry on this machine only)")


def run(args: argparse.Namespace) -> int:
    from shardwise.worker.fetch.oci import ENV_PASSWORD, ENV_USERNAME
    from shardwise.worker.fetch.oci_push import push_folder
    from shardwise.worker.fetch.registry import Registry
    from shardwise.worker.fetch.remote import RemoteError

    target = _target(args.target)
    folder = Path(args.folder)
    if isinstance(target, str):
        return _fail(target)
    if not folder.is_dir():
        return _fail(f"{folder}: not a folder")
    username = args.username or os.environ.get(ENV_USERNAME) or None
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else os.environ.get(ENV_PASSWORD)
    try:
        registry = Registry(target.registry, target.repository, args.plain_http, username, password)
        pushed = push_folder(registry, folder, target.tag)
    except (RemoteError, OSError) as e:
        return _fail(str(e))
    print(f"pushed {pushed.files} files ({pushed.bytes_total} bytes, {pushed.bytes_uploaded} uploaded) "
          f"to {target}")
    print(f"digest: {pushed.digest}")
    print(f"model.uri: oci://{target.location}@{pushed.digest}")
    return 0


def _target(text: str):
    """The OciUri to push to (tag latest when none is given), or why it is not one (one line): the
    same grammar a ShardedModel's model.uri is read with."""
    from shardwise.crds.modelsource import ModelUriError, OciUri, parse_model_uri
    if not text.startswith("oci://"):
        return f"{text[:200]!r} is not oci://REGISTRY[:PORT]/REPOSITORY[:TAG]"
    last = text.rsplit("/", 1)[-1]
    if text.count("/") >= 3 and ":" not in last and "@" not in last:
        text += ":latest"
    try:
        target = parse_model_uri(text)
    except ModelUriError as e:
        return str(e).replace("model.uri", "the target", 1)
    if not isinstance(target, OciUri):
        return f"{text[:200]!r} is not oci://REGISTRY[:PORT]/REPOSITORY[:TAG]"
    if target.digest:
        return "push names a tag (a digest is what the push answers)"
    return target


def _fail(message: str) -> int:
    print(f"shardwise push: {message}", file=sys.stderr)
    return 2
