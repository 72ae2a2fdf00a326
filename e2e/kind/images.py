"""Build the images from package registries alone: no container registry is needed anywhere.

    Debian root file system  debootstrap from the Debian mirror, `docker import`  -> shardwise/debian
    Python base              Debian's python3 on it (docker/python-base.Dockerfile) -> shardwise/python
    operator, worker         docker/*.Dockerfile on a base image, packages from PyPI

The bases are built once and reused while they exist (`force` rebuilds them); the operator and worker
images are built every time, from the sources as they are, and Docker's layer cache makes an unchanged
build take seconds. Docker's output goes to a log file under the cache; the console gets one line a
step, a heartbeat while it runs, and on failure one line naming the step, docker's last line and the
log.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.e2e import build
from shardwise.e2e.kind import space
from shardwise.e2e.kind.docker import DockerError, image_exists

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ROOT / "docker"

DEBIAN_SUITE = "bookworm"
DEBIAN_IMAGE = f"shardwise/debian:{DEBIAN_SUITE}"
PYTHON_IMAGE = "shardwise/python:3.11"
PUBLIC_PYTHON_IMAGE = "python:3.11-slim"


@dataclass(frozen=True)
class ProductImages:
    operator: str
    worker: str


def product_images(tag: str) -> ProductImages:
    """The names the chart and the suite use for one tag (the worker's CPU variant)."""
    return ProductImages(operator=f"shardwise/operator:{tag}", worker=f"shardwise/worker:{tag}-cpu")


def log_path() -> Path:
    return build.cache_root() / "images.log"


def debian_mirror() -> str:
    """$SHARDWISE_DEBIAN_MIRROR, else the mirror this host's apt uses, else Debian's CDN."""
    if os.environ.get("SHARDWISE_DEBIAN_MIRROR"):
        return os.environ["SHARDWISE_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        # deb822 ("URIs: http://…/debian") or one-line ("deb http://…/debian bookworm main").
        match = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+/debian)/?\s", text, re.M)
        if match:
            return match.group(1)
    return "http://deb.debian.org/debian"


def extra_ca_certs() -> str:
    """Local CAs this host trusts beyond Debian's (a TLS-intercepting proxy's): builds pass them to pip."""
    folder = Path(os.environ.get("SHARDWISE_EXTRA_CA_DIR", "/usr/local/share/ca-certificates"))
    return "".join(p.read_text() for p in sorted(folder.rglob("*.crt")) if p.is_file())


def run_logged(cmd: list[str], label: str, say, cwd: Path | None = None, stdin=None) -> None:
    """Run a long command with its output in the log; raise DockerError with its last line on failure."""
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            rc = build.run_with_progress(cmd, cwd, None, log, label, say, stdin=stdin)
        except FileNotFoundError:
            raise DockerError(f"{cmd[0]}: not found on PATH") from None
    if rc != 0:
        raise DockerError(f"{label} failed: {_log_tail(path)} (full log: {path})")
    say(f"  {label}: done in {time.monotonic() - start:.0f}s")


def _log_tail(path: Path) -> str:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1].strip() if lines else "no output"


def build_debian(say=print, force: bool = False) -> str:
    """A minimal Debian root file system from the Debian mirror, imported as an image."""
    if image_exists(DEBIAN_IMAGE) and not force:
        return DEBIAN_IMAGE
    if not shutil.which("debootstrap"):
        raise DockerError(f"{DEBIAN_IMAGE} is not there and debootstrap is missing: install it "
                          "(Debian: `apt-get install debootstrap`), or pull a Debian image and tag it "
                          f"{DEBIAN_IMAGE}")
    if os.geteuid() != 0:
        raise DockerError(f"building {DEBIAN_IMAGE} with debootstrap needs root")
    mirror = debian_mirror()
    say(f"building {DEBIAN_IMAGE} with debootstrap from {mirror}")
    with tempfile.TemporaryDirectory(prefix="shardwise-rootfs-") as rootfs:
        run_logged(["debootstrap", "--variant=minbase", "--include=ca-certificates",
                    DEBIAN_SUITE, rootfs, mirror], "debootstrap", say)
        tar = subprocess.Popen(["tar", "-C", rootfs, "--numeric-owner", "-c", "."],
                               stdout=subprocess.PIPE)
        try:
            run_logged(["docker", "import", "--change", 'CMD ["bash"]', "-", DEBIAN_IMAGE],
                       "docker import", say, stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait()
    return DEBIAN_IMAGE


def docker_build(dockerfile: Path, tag: str, context: Path, say, build_args: dict[str, str] | None = None,
                 force: bool = True, target: str | None = None) -> str:
    """`docker build` (with `force=False`, only if the image is not there yet; `target`: one stage);
    EXTRA_CA_CERTS is passed where the Dockerfile takes it. The image carries space.LABEL, so one a
    later build supersedes can be told from anyone else's."""
    if not force and image_exists(tag):
        say(f"{tag}: present")
        return tag
    args = dict(build_args or {})
    if "ARG EXTRA_CA_CERTS" in dockerfile.read_text():
        args.setdefault("EXTRA_CA_CERTS", extra_ca_certs())
    cmd = ["docker", "build", "-f", str(dockerfile), "-t", tag, "--label", f"{space.LABEL}=1"]
    if target:
        cmd += ["--target", target]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    say(f"building {tag} ({dockerfile.relative_to(ROOT) if dockerfile.is_relative_to(ROOT) else dockerfile})")
    run_logged([*cmd, str(context)], f"docker build {tag}", say)
    return tag


def build_python_base(say=print, force: bool = False) -> str:
    build_debian(say)
    return docker_build(DOCKERFILES / "python-base.Dockerfile", PYTHON_IMAGE, DOCKERFILES, say,
                        {"DEBIAN_IMAGE": DEBIAN_IMAGE}, force=force)


def build_product(tag: str, base: str | None = None, say=print) -> ProductImages:
    """The operator and worker images (CPU variant with the demo model) on `base`, from the sources
    as they are.

    No base named: the public Python image when it is already here, else the offline one."""
    if base is None:
        base = PUBLIC_PYTHON_IMAGE if image_exists(PUBLIC_PYTHON_IMAGE) else build_python_base(say)
    elif base == PYTHON_IMAGE:
        build_python_base(say)
    elif not image_exists(base):
        raise DockerError(f"base image {base} is not there: pull it, or leave --base out to build "
                          f"the offline one ({PYTHON_IMAGE})")
    names = product_images(tag)
    _build_with_stages(DOCKERFILES / "operator.Dockerfile", names.operator, say, {"BASE_IMAGE": base})
    _build_with_stages(DOCKERFILES / "worker.Dockerfile", names.worker, say,
                       {"BASE_IMAGE": base, "VARIANT": "cpu", "DEMO_MODEL": "true"})
    return names


def _build_with_stages(dockerfile: Path, tag: str, say, build_args: dict[str, str]) -> None:
    """Each named stage first, under a tag of its own (space.stage_tag): Docker's cache of a stage is
    that stage's image, which without a tag would look superseded once the build is done. The final
    build then takes every stage from the cache."""
    for stage in space.stages(dockerfile):
        docker_build(dockerfile, space.stage_tag(tag, stage), ROOT, say, build_args, target=stage)
    docker_build(dockerfile, tag, ROOT, say, build_args)

