"""`shardwise push FOLDER oci://registry[:port]/repository:tag`: upload a model folder to a registry
as an OCI artifact that a ShardedModel's `model.uri: oci://...` reads (one layer per file, named by
its path; see worker/fetch/oci_push.py), and print the manifest digest to pin the uri to.

Credentials come from OCI_USERNAME and OCI_PASSWORD (or --username with the password on stdin),
never from the command line, and are never printed. Bad input is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# oci://host[:port]/repository(:tag | @sha256:digest); the parts are checked by the registry client
# and the registry itself.
_TARGET = re.compile(r"oci://(?P<host>[^/\s]+)/(?P<repo>[^:@\s]+)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?")


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

    m = _TARGET.fullmatch(args.target)
    folder = Path(args.folder)
    if m is None:
        return _fail(f"{args.target!r} is not oci://REGISTRY[:PORT]/REPOSITORY[:TAG]")
    if not folder.is_dir():
        return _fail(f"{folder}: not a folder")
    username = args.username or os.environ.get(ENV_USERNAME) or None
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else os.environ.get(ENV_PASSWORD)
    tag = m["tag"] or "latest"
    try:
        registry = Registry(m["host"], m["repo"], args.plain_http, username, password)
        pushed = push_folder(registry, folder, tag)
    except (RemoteError, OSError) as e:
        return _fail(str(e))
    print(f"pushed {pushed.files} files ({pushed.bytes_total} bytes, {pushed.bytes_uploaded} uploaded) "
          f"to oci://{m['host']}/{m['repo']}:{tag}")
    print(f"digest: {pushed.digest}")
    print(f"model.uri: oci://{m['host']}/{m['repo']}@{pushed.digest}")
    return 0


def _fail(message: str) -> int:
    print(f"shardwise push: {message}", file=sys.stderr)
    return 2
