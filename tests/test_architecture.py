"""The house rules: each package's `__init__` docstring says what it may import, and this holds them.

A package's docstring carries two lines the test reads (the one place each rule is written):

    May import: shardwise.crds, shardwise.worker.model      (other shardwise packages it may use)
    Never imports: torch, kopf                              (third-party modules barred below it)

A module may import its own package's modules and whatever its package's "May import" names (a
subpackage without that line inherits its parent's). "Never imports" holds for the package and
everything below it. Every import counts, lazy ones inside functions too, since the operator image
(no torch) and the worker image (no kopf) run every path. Also: no import cycle between modules, and
no product module over 600 lines or function over 60.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"crds": "shardwise.crds", "operator": "shardwise.operator", "worker": "shardwise.worker",
         "e2e": "shardwise.e2e"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


@dataclass
class Rules:
    may_import: list[str] | None = None          # None: inherit the parent's
    never_imports: list[str] = field(default_factory=list)


def _rules(init: Path) -> Rules:
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    rules = Rules()
    for line in doc.splitlines():
        if line.startswith("May import:"):
            rules.may_import = re.findall(r"shardwise(?:\.\w+)+", line)
        elif line.startswith("Never imports:"):
            rules.never_imports = [n.strip() for n in line.split(":", 1)[1].split(",") if n.strip()]
    return rules


def _packages() -> dict[str, Rules]:
    out = {}
    for folder, name in PARTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder).parts
            out[".".join((name, *rel))] = _rules(init)
    return out


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((name, *rel))] = path
    return out


MODULES = _modules()
PACKAGES = _packages()


def _imports(module: str, path: Path) -> list[str]:
    """Every module `module` imports, absolute, lazy imports included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:   # `from pkg import module` imports pkg.module
                names.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def _package_of(module: str) -> str:
    return module if module in PACKAGES else module.rpartition(".")[0]


def _effective(package: str) -> tuple[list[str], list[str]]:
    may, never, name = None, [], package
    while name in PACKAGES:
        rules = PACKAGES[name]
        if may is None and rules.may_import is not None:
            may = rules.may_import
        never += rules.never_imports
        name = name.rpartition(".")[0]
    return may or [], never


def _allowed(target: str, package: str, may: list[str]) -> bool:
    if _package_of(target) == package or target == package:
        return True
    return any(target == p or target.startswith(p + ".") for p in may)


def test_every_package_states_its_rules():
    missing = [p for p, r in PACKAGES.items() if r.may_import is None and p in PARTS.values()]
    assert not missing, f"top-level packages without a 'May import:' line: {missing}"
    undocumented = [p for p in PACKAGES if not ast.get_docstring(ast.parse(MODULES[p].read_text()))]
    assert not undocumented, f"packages whose __init__ says nothing: {undocumented}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_rules(module):
    package = _package_of(module)
    may, never = _effective(package)
    wrong = []
    for target in _imports(module, MODULES[module]):
        top = target.split(".")[0]
        if top in never or any(target == n or target.startswith(n + ".") for n in never):
            wrong.append(f"{target} (never imported under {package})")
        elif target.startswith("shardwise.") and target.split(".")[1] in ("crds", "operator", "worker", "e2e"):
            if not _allowed(target, package, may):
                wrong.append(f"{target} (not in {package}'s 'May import')")
    assert not wrong, f"{module} imports " + "; ".join(wrong)


def test_no_import_cycle():
    graph = {m: {t for t in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # A package's __init__ is imported on the way to any of its modules; count only real edges.
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_and_functions_stay_small():
    big_modules, big_functions = [], []
    for module, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big_modules.append(f"{module} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big_functions.append(f"{module}.{node.name} ({n} lines)")
    assert not big_modules and not big_functions, \
        f"over {MAX_MODULE_LINES} lines: {big_modules}; functions over {MAX_FUNCTION_LINES}: {big_functions}"


def test_every_package_is_installed():
    """A package missing from pyproject's list works in a checkout and is absent from the images."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert set(PACKAGES) - listed == set(), f"packages missing from pyproject.toml: {sorted(set(PACKAGES) - listed)}"
