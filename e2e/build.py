"""Build the pinned Kubernetes binaries from their Go modules into a cache outside the repo.

Every binary comes from the Go module proxy through a small wrapper module, so the build needs only
`go` and the proxy: no git clone, no Docker. The cache folder is keyed by a hash of the pins, so a
changed pin builds afresh and an unchanged one is reused in well under a second.

Two sets share the cache: the local control plane's (`ALL_BINARIES`, `shardwise dev build`) and the
kind cluster's (`KIND_BINARIES`, `shardwise kind build`): the node's kubelet, kubeadm and kube-proxy,
the `kind` CLI, the cluster add-ons kubeadm and the pod network run (CoreDNS, flannel), and the
image registry the nodes pull the product images from (distribution).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# One recent Kubernetes minor that kwok v0.8.0 supports (it defaults to 1.36).
KUBERNETES = "v1.36.3"
ETCD = "v3.6.16"
KWOK = "v0.8.0"
HELM = "v3.22.0"
KIND = "v0.33.0"
# The CoreDNS release kubeadm v1.36 deploys (its constants.CoreDNSVersion), so the image it asks for
# by name holds that version.
COREDNS = "v1.14.2"
FLANNEL = "v0.28.10"
REGISTRY = "v3.1.2"
GO_MIN = (1, 26)

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
ALL_BINARIES = ("etcd", *K8S_BINARIES, "kwok", "helm")
KIND_NODE_BINARIES = ("kubelet", "kubeadm", "kube-proxy")
KIND_BINARIES = (*KIND_NODE_BINARIES, "kind", "coredns", "flanneld", "registry")


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log file."""


def pins() -> dict[str, str]:
    return {"kubernetes": KUBERNETES, "etcd": ETCD, "kwok": KWOK, "helm": HELM, "kind": KIND,
            "coredns": COREDNS, "flannel": FLANNEL, "registry": REGISTRY}


def cache_root() -> Path:
    base = os.environ.get("SHARDWISE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardwise")
    return Path(base)


def bin_dir() -> Path:
    digest = hashlib.sha256(json.dumps(pins(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "bin" / digest


def missing_binaries(directory: Path | None = None, wanted: tuple[str, ...] = ALL_BINARIES) -> list[str]:
    directory = directory or bin_dir()
    return [b for b in wanted if not os.access(directory / b, os.X_OK)]


@dataclass
class _Step:
    name: str
    module_dir: Path
    go_mod: str
    packages: list[str]
    ldflags: str = ""
    # The binary a package's last path element names, where the cache keeps it under another name.
    renames: dict[str, str] | None = None
    # Prepares a local copy of the module before the build; returns go.mod lines to use it.
    prepare: Callable[[Path], str] | None = None
    # cgo, linked statically (for modules with C parts); otherwise CGO_ENABLED=0.
    cgo: bool = False

    def binary(self, package: str) -> str:
        produced = package.rsplit("/", 1)[-1]
        return (self.renames or {}).get(produced, produced)


def _go_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CGO_ENABLED="0", GOFLAGS="-mod=mod -buildvcs=false", GOTOOLCHAIN="local",
               GOWORK="off")
    return env


def _check_go() -> None:
    go = shutil.which("go")
    if not go:
        raise BuildError("go: not found on PATH; install Go >= %d.%d to build the local control plane"
                         % GO_MIN)
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
    try:
        major, minor = (int(x) for x in out.removeprefix("go").split(".")[:2])
    except ValueError:
        return
    if (major, minor) < GO_MIN:
        raise BuildError(f"go: {out} is too old; Kubernetes {KUBERNETES} needs go{GO_MIN[0]}.{GO_MIN[1]}")


def download_module(module: str, version: str, log=None) -> dict:
    """`go mod download -json module@version` (into Go's module cache, reused when there): its
    `Dir` (the module's files) and `GoMod` (its go.mod)."""
    work = cache_root() / "src"
    work.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"],
                         cwd=work, env=_go_env(work), capture_output=True, text=True)
    if log is not None:
        log.write(out.stdout + out.stderr)
    try:
        info = json.loads(out.stdout)
    except ValueError:
        info = {"Error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    if out.returncode != 0 or info.get("Error"):
        raise BuildError(f"downloading {module}@{version} failed: {info.get('Error')}")
    return info


def _kubernetes_replaces(work: Path, log) -> str:
    """k8s.io/kubernetes points its staging modules at ./staging; pin each to the published v0.N.M."""
    gomod = Path(download_module("k8s.io/kubernetes", KUBERNETES, log)["GoMod"]).read_text()
    staging_version = "v0." + KUBERNETES.removeprefix("v1.")
    lines = []
    for line in gomod.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            lines.append(f"\t{parts[0]} => {parts[0]} {staging_version}")
    if not lines:
        raise BuildError("k8s.io/kubernetes go.mod has no staging replace lines; the pin layout changed")
    return "replace (\n" + "\n".join(lines) + "\n)\n"


def _k8s_ldflags() -> str:
    major, minor, _ = KUBERNETES.removeprefix("v").split(".")
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={KUBERNETES}", f"-X {pkg}.gitMajor={major}",
                  f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean",
                  f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return " ".join(flags)


def _helm_kube_ldflags() -> str:
    """The Kubernetes version `helm template` and `helm lint` assume when no cluster is asked (helm's
    Makefile stamps it; unstamped it says 1.20, which charts that need a newer one refuse)."""
    major, minor, _ = KUBERNETES.removeprefix("v").split(".")
    return " ".join(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersion{part}={value}"
                    for pkg in ("chartutil", "lint/rules") for part, value in (("Major", major), ("Minor", minor)))


def _steps(work: Path, log) -> list[_Step]:
    def step(name: str, module: str, version: str, packages: list[str], ldflags: str = "-s -w",
             go_mod_extra: str = "", **options) -> _Step:
        go_mod = f"module shardwise.dev/build/{name}\n\ngo 1.26.0\n\nrequire {module} {version}\n"
        return _Step(name, work / name, go_mod + go_mod_extra, packages, ldflags, **options)

    return [
        # go build names a /vN module's binary after the element before the suffix ("server");
        # earlier Go releases named it after the suffix ("v3").
        step("etcd", "go.etcd.io/etcd/server/v3", ETCD, ["go.etcd.io/etcd/server/v3"],
             renames={"server": "etcd", "v3": "etcd"}),
        step("kubernetes", "k8s.io/kubernetes", KUBERNETES,
             [f"k8s.io/kubernetes/cmd/{b}" for b in (*K8S_BINARIES, *KIND_NODE_BINARIES)],
             _k8s_ldflags(), _kubernetes_replaces(work, log)),
        step("kwok", "sigs.k8s.io/kwok", KWOK, ["sigs.k8s.io/kwok/cmd/kwok"],
             f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={KWOK}"),
        step("helm", "helm.sh/helm/v3", HELM, ["helm.sh/helm/v3/cmd/helm"],
             f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM} " + _helm_kube_ldflags()),
        step("kind", "sigs.k8s.io/kind", KIND, ["sigs.k8s.io/kind"]),
        step("coredns", "github.com/coredns/coredns", COREDNS, ["github.com/coredns/coredns"],
             f"-s -w -X github.com/coredns/coredns/coremain.GitCommit={COREDNS}"),
        step("flannel", "github.com/flannel-io/flannel", FLANNEL, ["github.com/flannel-io/flannel"],
             f"-s -w -X github.com/flannel-io/flannel/pkg/version.Version={FLANNEL} -extldflags \"-static\"",
             renames={"flannel": "flanneld"}, prepare=_flannel_source, cgo=True),
        step("registry", "github.com/distribution/distribution/v3", REGISTRY,
             ["github.com/distribution/distribution/v3/cmd/registry"],
             f"-s -w -X github.com/distribution/distribution/v3/version.version={REGISTRY}"),
    ]


def _flannel_source(module_dir: Path) -> str:
    """flannel without its Tencent Cloud VPC backend, whose SDK the Go module proxy does not serve (the
    kind network uses host-gw): a copy of the module whose tencentvpc package is empty."""
    src = module_dir / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(download_module("github.com/flannel-io/flannel", FLANNEL)["Dir"], src)
    subprocess.run(["chmod", "-R", "u+w", str(src)], check=True)   # the module cache is read-only
    (src / "pkg" / "backend" / "tencentvpc" / "tencentvpc.go").write_text(
        "//go:build !windows\n\n// Left out of this build: its SDK is not on the Go module proxy.\n"
        "package tencentvpc\n")
    gomod = src / "go.mod"
    gomod.write_text("".join(line for line in gomod.read_text().splitlines(keepends=True)
                             if "tencentcloud-sdk-go/tencentcloud/vpc" not in line))
    return "\nreplace github.com/flannel-io/flannel => ./src\n"


def run_with_progress(cmd: list[str], cwd: Path | None, env: dict | None, log, label: str, say,
                      stdin=None) -> int:
    """Run `cmd` with its output in `log`, saying every 30 s that it still works; its exit status."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=log, stderr=subprocess.STDOUT)
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(30):
            say(f"  … {label}: still working ({time.monotonic() - start:.0f}s)")

    t = threading.Thread(target=heartbeat, daemon=True)
    t.start()
    try:
        return proc.wait()
    finally:
        done.set()


def build(force: bool = False, say=print, wanted: tuple[str, ...] = ALL_BINARIES) -> Path:
    """Build whatever of `wanted` is missing from the cache and return the folder holding it."""
    target = bin_dir()
    missing = wanted if force else missing_binaries(target, wanted)
    if not missing:
        return target
    _check_go()
    target.mkdir(parents=True, exist_ok=True)
    work = cache_root() / "src"
    work.mkdir(parents=True, exist_ok=True)
    log_path = cache_root() / "build.log"
    say(f"building {', '.join(missing)} into {target} (log: {log_path}); "
        "this takes several minutes on two cores")
    with open(log_path, "a") as log:
        for step in _steps(work, log):
            packages = [p for p in step.packages if step.binary(p) in missing]
            if not packages:
                continue
            step.module_dir.mkdir(parents=True, exist_ok=True)
            (step.module_dir / "go.mod").write_text(
                step.go_mod + (step.prepare(step.module_dir) if step.prepare else ""))
            # cgo steps link statically (netgo/osusergo keep glibc's resolver out), so every
            # binary runs on any Linux image.
            env = {**_go_env(work), "CGO_ENABLED": "1"} if step.cgo else _go_env(work)
            t0 = time.monotonic()
            say(f"[{step.name}] downloading modules")
            rc = run_with_progress(["go", "mod", "download"], step.module_dir, env, log,
                                    f"{step.name} download", say)
            if rc != 0:
                raise BuildError(f"[{step.name}] go mod download failed (exit {rc}); see {log_path}")
            with tempfile.TemporaryDirectory(dir=target) as out:
                cmd = ["go", "build", "-trimpath", "-ldflags", step.ldflags, "-o", out + "/",
                       *(["-tags", "netgo,osusergo"] if step.cgo else []), *packages]
                say(f"[{step.name}] compiling {' '.join(step.binary(p) for p in packages)}")
                log.write(f"\n$ (cd {step.module_dir}) {' '.join(cmd)}\n")
                log.flush()
                rc = run_with_progress(cmd, step.module_dir, env, log, f"{step.name} compile", say)
                if rc != 0:
                    raise BuildError(f"[{step.name}] go build failed (exit {rc}); see {log_path}")
                for produced in Path(out).iterdir():
                    os.replace(produced, target / (step.renames or {}).get(produced.name, produced.name))
            say(f"[{step.name}] done in {time.monotonic() - t0:.0f}s")
    (target / "versions.json").write_text(json.dumps(pins(), indent=2) + "\n")
    left = missing_binaries(target, wanted)
    if left:
        raise BuildError(f"build finished but {', '.join(left)} is missing from {target}; see {log_path}")
    return target


if __name__ == "__main__":
    try:
        print(build(force="--force" in sys.argv,
                    wanted=KIND_BINARIES if "--kind" in sys.argv else ALL_BINARIES))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
