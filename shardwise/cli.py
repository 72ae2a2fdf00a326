"""The one `shardwise` command. Each subcommand lives in the part of the product it belongs to.

A subcommand's module is imported only when that subcommand runs, so the operator image (no torch)
and the worker image (no kopf) each carry the same CLI. Every module named here provides
`add_arguments(parser)` and `run(args) -> int`, and keeps heavy imports inside `run`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("shardwise.operator.cli.plan", "compute a topology-aware sharding plan for a ShardedModel"),
    "crds": ("shardwise.crds.cli.crds", "generate or check the CRD YAML from the API models"),
    "inspect": ("shardwise.crds.cli.inspect", "print a model's shape and its size in GPU memory (no torch needed)"),
    "operator": ("shardwise.operator.cli.run", "run the Kubernetes operator"),
    "router": ("shardwise.operator.router.cli", "a model's front door: route, migrate streams, hold, keys, limits"),
    "generate": ("shardwise.worker.cli.generate", "generate text with a sharded model on local processes"),
    "serve": ("shardwise.worker.cli.serve", "serve a sharded model over an OpenAI-compatible HTTP API"),
    "train": ("shardwise.worker.cli.train", "train a sharded model and write sharded checkpoints"),
    "fetch": ("shardwise.worker.cli.fetch", "fetch a model from an object store into a node-local cache"),
    "push": ("shardwise.worker.cli.push", "push a model folder to a registry as an OCI artifact (for oci:// models)"),
    "worker": ("shardwise.worker.cli.pod", "run one ShardedModel pod's ranks (pod contract + rendezvous variables)"),
    "dev": ("shardwise.e2e.cli.dev", "start, inspect and stop the local Kubernetes control plane"),
    "demo": ("shardwise.e2e.cli.demo", "run the operator and a sharded SmolLM2 on a local cluster"),
    "kind": ("shardwise.e2e.cli.kind", "build the images and a kind cluster from package registries"),
}

# A command whose MODEL argument names a store (hf://, s3://, oci://) runs this module's `run` with
# the same arguments instead: the worker reads stores, and the crds command stays free of it.
REMOTE_MODEL: dict[str, str] = {"inspect": "shardwise.worker.cli.inspect"}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: shardwise <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `shardwise <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from shardwise import __version__
        print(f"shardwise {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"shardwise: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return _missing(name, e)
    parser = argparse.ArgumentParser(prog=f"shardwise {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        if name in REMOTE_MODEL and _names_a_store(args.model):
            module = importlib.import_module(REMOTE_MODEL[name])
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:   # a heavy import inside run()
        return _missing(name, e)


def _names_a_store(uri: str) -> bool:
    from shardwise.crds.modelsource import SourceScheme, scheme_of
    return scheme_of(uri) in (SourceScheme.HF.value, SourceScheme.S3.value, SourceScheme.OCI.value)


def _missing(command: str, error: ImportError) -> int:
    # The operator image has no torch and the worker image no kopf: say which extra is missing.
    extra = "demo" if command in ("dev", "demo") else "operator,worker"
    print(f"shardwise {command}: needs a dependency that is not installed ({error.name or error}); "
          f"install it with `pip install 'shardwise[{extra}]'`", file=sys.stderr)
    return 2
