"""Shared fixtures: the local Kubernetes control plane (see shardwise.e2e.pytest_plugin for the list:
cluster, kube_api, namespace, kubectl, node_factory)."""
import os

from shardwise.e2e.pytest_plugin import *  # noqa: F401,F403  (pytest finds fixtures by name)

# The repository root holds the folder `operator/`, which shadows the standard library's `operator`
# in any `python -m ...` whose working directory is the root (the default for the processes tests
# start, `python -m shardwise` included): its directory comes first on sys.path, and a Python whose
# start-up has not imported `operator` already (a plain virtualenv) fails in runpy. Python 3.11's
# safe-path mode keeps the working directory off sys.path.
os.environ.setdefault("PYTHONSAFEPATH", "1")


# Where CI's time goes, a file at a time (--durations lists single tests only): the sum of each
# test file's setup, call and teardown phases, the 25 largest, printed at the end of the run.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + (report.duration or 0.0)


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("slowest 25 test files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f}s in all test phases")
