"""`shardwise crds generate [-o FILE]` and `shardwise crds check [FILE ...]`."""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write the CRD YAML generated from the API models")
    gen.add_argument("-o", "--output", help="file to write (default: standard output; '-' too)")
    check = sub.add_parser("check", help="exit non-zero when a CRD file differs from the models")
    check.add_argument("files", nargs="*", help="CRD files to compare (default: the checked-in one and the chart's copy)")


def run(args: argparse.Namespace) -> int:
    from shardwise.crds.schema import CRD_FILE, crd_yaml

    text = crd_yaml()
    if args.action == "generate":
        if not args.output or args.output == "-":
            sys.stdout.write(text)
        else:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}", file=sys.stderr)
        return 0
    drifted = 0
    # the Helm chart carries a copy of the CRD; in a source checkout it must match as well
    chart_copy = CRD_FILE.parent.parent / "charts" / "shardwise" / "crds" / CRD_FILE.name
    for name in args.files or [str(CRD_FILE)] + ([str(chart_copy)] if chart_copy.exists() else []):
        path = Path(name)
        if not path.exists():
            print(f"{name}: missing; run `shardwise crds generate -o {name}`", file=sys.stderr)
            drifted += 1
            continue
        current = path.read_text()
        if current == text:
            print(f"{name}: up to date")
            continue
        drifted += 1
        diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), name, "models", lineterm="", n=1))
        print("\n".join(diff[:40]), file=sys.stderr)
        print(f"{name}: differs from crds/models.py; run `shardwise crds generate -o {name}`", file=sys.stderr)
    return 1 if drifted else 0
