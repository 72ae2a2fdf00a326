"""Fast checks of the Dockerfiles (tests/kind builds and runs them for real): a package folder the build
context leaves out, a dependency extra that pulls torch into the operator image, a user that doesn't
match the chart's security context."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile(name: str) -> str:
    return (DOCKER / f"{name}.Dockerfile").read_text()


def copied(text: str) -> set[str]:
    return {src.rstrip("/") for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M)
            for src in line.split()[:-1]}


def test_images_copy_every_package_folder_and_the_files_the_build_reads():
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    # The build context is the repository root; its .dockerignore must let every copied path through.
    ignore = set((ROOT / ".dockerignore").read_text().splitlines())
    for name in ("operator", "worker"):
        text = dockerfile(name)
        assert folders | {"pyproject.toml", "README.md"} <= copied(text), name
        for path in copied(text) - {"pyproject.toml", "README.md"}:
            # `!folder/` lets everything under it through (the worker's kernels stage copies two
            # files of worker/weights/ alone)
            allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
            assert any(path == a or path.startswith(a + "/") for a in allowed), (name, path)


def test_operator_image_installs_the_operator_extra_which_has_no_torch():
    text = dockerfile("operator")
    assert '"/src[operator]"' in text and "[worker]" not in text
    extra = " ".join(PYPROJECT["project"]["optional-dependencies"]["operator"]).lower()
    assert "torch" not in extra and "numpy" not in extra
    worker = dockerfile("worker")
    # The worker's dependencies are read from pyproject.toml's worker extra (the package itself is
    # installed without dependencies).
    assert "['optional-dependencies']['worker']" in worker and "[operator]" not in worker
    assert "kopf" not in " ".join(PYPROJECT["project"]["optional-dependencies"]["worker"]).lower()


def test_worker_image_variants_pick_the_torch_build():
    text = dockerfile("worker")
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    # Both variants take torch from PyPI alone (a CUDA build); the cpu one then drops what a CPU-only
    # pod never loads, before the venv is copied into the image.
    assert re.search(r'if \[ "\$VARIANT" = cpu \]; then\s+\\\s+\S+python \S*slim_torch.py', text)
    assert not [line for line in text.splitlines()
                if "download.pytorch.org" in line and not line.startswith("#")]


def test_images_run_as_the_non_root_user_the_chart_expects():
    values = yaml.safe_load((ROOT / "charts" / "shardwise" / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert uid != 0
    for name in ("operator", "worker"):
        users = re.findall(r"^USER (\S+)$", dockerfile(name), re.M)
        assert users and users[-1] == f"{uid}:{uid}", name
