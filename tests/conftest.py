"""Shared fixtures: the local Kubernetes control plane (see shardwise.e2e.pytest_plugin for the list:
cluster, kube_api, namespace, kubectl, node_factory)."""
from shardwise.e2e.pytest_plugin import *  # noqa: F401,F403  (pytest finds fixtures by name)
