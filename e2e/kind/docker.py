"""The Docker engine as the kind suite needs it: found, answering, and able to run privileged nodes.

kind starts every node as `docker run --privileged`, which asks the runtime for every capability the
kernel knows. In a restricted sandbox (a container or VM whose capability bounding set lacks one, often
CAP_SYS_RESOURCE) runc then fails with "unable to apply caps: operation not permitted". The fix is a
runtime wrapper for the Docker daemon: `runc-capped` removes from each container's OCI spec the
capabilities this host cannot grant, then runs the real runc. It is installed only where the bounding
set is short (`capabilities_missing()`), never assumed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shardwise.e2e import build

RUNTIME_NAME = "shardwise-runc"
DAEMON_JSON = Path("/etc/docker/daemon.json")

# Linux capability numbers -> names, as far as /proc/sys/kernel/cap_last_cap may reach today.
CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)


class DockerError(RuntimeError):
    """Docker, an image build, kind or the kind cluster could not do what was asked; the message is
    one line that says what and how to fix it."""


def capabilities_missing(status: str | None = None, last_cap: int | None = None) -> list[str]:
    """The capabilities the kernel knows that this process's bounding set lacks (`CAP_` names)."""
    if status is None:
        status = Path("/proc/self/status").read_text()
    if last_cap is None:
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    bounding = next(int(line.split()[1], 16) for line in status.splitlines()
                    if line.startswith("CapBnd:"))
    return [f"CAP_{CAPABILITIES[n]}" if n < len(CAPABILITIES) else f"CAP_{n}"
            for n in range(last_cap + 1) if not bounding >> n & 1]


def docker(*args: str, check: bool = True, capture: bool = True, timeout: float | None = None,
           input: bytes | None = None) -> subprocess.CompletedProcess:
    """Run the docker CLI; a failure raises DockerError with docker's own last line."""
    try:
        proc = subprocess.run(["docker", *args], capture_output=capture, timeout=timeout, input=input)
    except FileNotFoundError:
        raise DockerError("docker: not found on PATH; install Docker "
                          "(Debian: `apt-get install docker.io`) and start dockerd") from None
    if check and proc.returncode != 0:
        raise DockerError(f"docker {args[0]} failed: {_last_line(proc)}")
    return proc


def _last_line(proc: subprocess.CompletedProcess) -> str:
    text = ((proc.stderr or b"") + (proc.stdout or b"")).decode(errors="replace").strip()
    return text.splitlines()[-1] if text else f"exit {proc.returncode}"


def check_daemon() -> dict:
    """`docker info` as a dict; one-line errors for a missing CLI or a daemon that does not answer."""
    proc = docker("info", "--format", "{{json .}}", check=False, timeout=60)
    if proc.returncode != 0:
        raise DockerError("the Docker daemon is not answering (" + _last_line(proc) + "); start it "
                          "(`systemctl start docker`, or `shardwise kind docker --start` where there "
                          "is no systemd)")
    return json.loads(proc.stdout)


def image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False).returncode == 0


def image_size(ref: str) -> int:
    """Bytes of an image's layers, as `docker image inspect` reports them."""
    return int(docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.decode().strip())


def runtime_wrapper_path() -> Path:
    return build.cache_root() / "docker" / "runc-capped"


def install_runtime_wrapper(runc: str | None = None) -> Path:
    """Write the capability-dropping runc wrapper into the cache and return its path."""
    runc = runc or shutil.which("runc") or "/usr/bin/runc"
    path = runtime_wrapper_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_WRAPPER.replace("@PYTHON@", sys.executable).replace("@RUNC@", runc))
    path.chmod(0o755)
    return path


def configure_daemon(wrapper: Path, daemon_json: Path = DAEMON_JSON) -> bool:
    """Make the wrapper dockerd's default runtime; True when daemon.json changed (restart dockerd)."""
    config = json.loads(daemon_json.read_text()) if daemon_json.exists() else {}
    wanted = dict(config)
    wanted.setdefault("runtimes", {})[RUNTIME_NAME] = {"path": str(wrapper)}
    wanted["default-runtime"] = RUNTIME_NAME
    if wanted == config:
        return False
    daemon_json.parent.mkdir(parents=True, exist_ok=True)
    daemon_json.write_text(json.dumps(wanted, indent=2) + "\n")
    return True


def start_daemon(log: Path, timeout: float = 60) -> None:
    """Start dockerd in the background (hosts without systemd) and wait until it answers."""
    dockerd = shutil.which("dockerd")
    if not dockerd:
        raise DockerError("dockerd: not found; install Docker (Debian: `apt-get install docker.io`)")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        subprocess.Popen([dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if docker("info", check=False, timeout=10).returncode == 0:
            return
        time.sleep(1)
    raise DockerError(f"dockerd did not answer within {timeout:.0f}s; see {log}")


def stop_daemon(timeout: float = 30) -> None:
    """Stop a dockerd started by `start_daemon` (SIGTERM, then wait for its pid file to go)."""
    pid_file = Path("/var/run/docker.pid")
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().strip() or 0)
    if pid:
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_file.exists():
        time.sleep(0.5)


# The runtime wrapper. dockerd calls it exactly as it calls runc; for `create`, `run` and `exec` it first
# drops, from the bundle's config.json or the exec's process file, every capability outside its own
# bounding set (which it inherits from dockerd, i.e. what this host can grant). Everything else passes
# straight through.
_WRAPPER = '''#!@PYTHON@
"""runc, minus the capabilities this host cannot grant (installed by `shardwise kind docker`)."""
import json, os, sys

RUNC = "@RUNC@"
args = sys.argv[1:]


def spec_file():
    """The JSON runc reads capabilities from: the bundle's config.json (create, run) or an exec's
    process file (exec --process)."""
    for i, a in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        if a in ("--bundle", "-b") and value:
            return os.path.join(value, "config.json"), True
        if a.startswith("--bundle="):
            return os.path.join(a.split("=", 1)[1], "config.json"), True
        if a in ("--process", "-p") and value:
            return value, False
        if a.startswith("--process="):
            return a.split("=", 1)[1], False
    return None, False


path, is_bundle = spec_file() if {"create", "run", "exec"} & set(args) else (None, False)
if path:
    status = open("/proc/self/status").read()
    bset = next(int(l.split()[1], 16) for l in status.splitlines() if l.startswith("CapBnd:"))
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    known = %r
    lacking = {"CAP_" + name for n, name in enumerate(known) if n <= last and not bset >> n & 1}
    spec = json.load(open(path))
    process = spec.get("process", {}) if is_bundle else spec
    caps = process.get("capabilities") or {}
    changed = False
    for kind, listed in caps.items():
        kept = [c for c in listed if c not in lacking]
        if kept != listed:
            caps[kind] = kept
            changed = True
    if changed:
        with open(path + ".tmp", "w") as f:
            json.dump(spec, f)
        os.replace(path + ".tmp", path)
os.execv(RUNC, [RUNC] + args)
''' % (CAPABILITIES,)
