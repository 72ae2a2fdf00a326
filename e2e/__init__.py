"""Local clusters for development, the demo and the tests: the local control plane (localcluster/),
kind clusters with images built from package registries (kind/), their commands (cli/), the
pinned build of the Kubernetes binaries (build), and the pytest fixtures (pytest_plugin).

May import: shardwise.crds, shardwise.operator, shardwise.e2e.localcluster
Never imports: torch
"""
