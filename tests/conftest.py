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
