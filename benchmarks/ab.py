"""A benchmark run on two revisions of this repository in alternating rounds, with the ratio of each figure.

    python benchmarks/ab.py --base 3855e67 [--rounds 3] [--json-key decode_tps ...]
                            [--regex NAME=PATTERN ...] -- benchmarks/worker_bench.py --layouts 1x1 --json

Why alternating: on a shared machine the load drifts over minutes, so old and new measured one after
the other in turns see the same drift; the best of each side's rounds is compared. Each side runs its
own copy of the benchmark script (a script follows its own revision's internal APIs) as
`python3 SCRIPT ARGS` in a tree of that revision, importing that revision's code: the base revision
is exported with `git archive` into ~/.cache/shardwise/ab/<commit>, the other side is the working
tree. A side imports its tree through a folder of links named as the package (`shardwise/crds` ->
`crds/`, ...), put first on PYTHONPATH, with PYTHONSAFEPATH=1 so the working directory cannot shadow it.

Figures are read from the output: `--json-key K` takes every number stored under key K in the last
line that parses as a JSON object (searched recursively, named by its path); `--regex NAME=PATTERN`
takes the first group of the last match of PATTERN (multiline) as NAME. `--higher-is-better` is the
default reading of a ratio; say `--lower NAME` for figures such as latencies.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"crds": "crds", "operator": "operator", "worker": "worker", "e2e": "e2e"}
CACHE = Path(os.environ.get("SHARDWISE_CACHE", Path.home() / ".cache" / "shardwise")) / "ab"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def export(rev: str) -> Path:
    """The tree of `rev`, exported once into the cache (a commit's tree never changes)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = CACHE / commit
    if not (tree / ".complete").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        tar = tree / ".tree.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:
            t.extractall(tree, filter="data")
        tar.unlink()
        (tree / ".complete").write_text(commit)
    return tree


def import_root(tree: Path) -> Path:
    """A folder whose `shardwise/` package maps each part to the tree's top-level folder."""
    root = tree / ".ab-import" if tree != ROOT else CACHE / "worktree-import"
    pkg = root / "shardwise"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {name: tree / "shardwise" / name for name in ("__init__.py", "__main__.py", "cli.py")}
    links.update({name: tree / folder for name, folder in PARTS.items()})
    for name, target in links.items():
        link = pkg / name
        if link.is_symlink() and Path(os.readlink(link)) != target:
            link.unlink()
        if not link.exists() and target.exists():
            link.symlink_to(target)
    return root


def run_side(tree: Path, script: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(import_root(tree)), "PYTHONSAFEPATH": "1",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(tree / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise SystemExit(f"ab: {script} failed in {tree} (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def _json_figures(obj, key: str, path: str = "") -> dict[str, float]:
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            if k == key and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[sub] = float(v)
            else:
                out.update(_json_figures(v, key, sub))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_json_figures(v, key, f"{path}[{i}]"))
    return out


def figures(output: str, keys: list[str], regexes: dict[str, re.Pattern]) -> dict[str, float]:
    out: dict[str, float] = {}
    if keys:
        last = None
        for line in output.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    last = json.loads(line)
                except json.JSONDecodeError:
                    continue
        for key in keys:
            out.update(_json_figures(last or {}, key))
    for name, pattern in regexes.items():
        matches = pattern.findall(output)
        if matches:
            out[name] = float(matches[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("ab: give the benchmark after `--`: ab.py --base REV -- benchmarks/X.py ARGS", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side is kept")
    ap.add_argument("--json-key", action="append", default=[], help="a key of the last JSON line to compare")
    ap.add_argument("--regex", action="append", default=[], help="NAME=PATTERN, the first group a number")
    ap.add_argument("--lower", action="append", default=[], help="a figure for which lower is better")
    args = ap.parse_args(argv[:split])
    script, bench_args = argv[split + 1], argv[split + 2:]
    regexes = {}
    for item in args.regex:
        name, sep, pattern = item.partition("=")
        if not sep:
            ap.error(f"--regex {item!r}: expected NAME=PATTERN")
        regexes[name] = re.compile(pattern, re.M)
    base = export(args.base)
    sides = {"base": base, "head": ROOT}
    seen: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    for r in range(args.rounds):
        for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
            t0 = time.perf_counter()
            got = figures(run_side(sides[side], script, bench_args), args.json_key, regexes)
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items())
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            for k, v in got.items():
                seen[side].setdefault(k, []).append(v)
    print(f"\nbest of {args.rounds} rounds, base {args.base} vs the working tree:")
    print(f"{'figure':<48} {'base':>12} {'head':>12} {'head/base':>10}")
    for k in sorted(set(seen["base"]) & set(seen["head"])):
        pick = min if k.split(".")[-1] in args.lower or k in args.lower else max
        b, h = pick(seen["base"][k]), pick(seen["head"][k])
        print(f"{k:<48} {b:>12.4g} {h:>12.4g} {h / b if b else float('nan'):>9.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
