"""Local clusters for development, the demo and the tests: the local control plane (localcluster/),
kind clusters with images built from package registries (kind/), the demo's run on a local cluster
(demo/), their commands (cli/), the pinned build of the Kubernetes binaries (build), the pytest
fixtures (pytest_plugin) and the README's console blocks as commands (readme); the remote model
stores run locally: a real S3 server built and started for the tests (s3server), a stand-in for the
Hugging Face Hub's API (hubserver) and the distribution registry on a loopback port (localregistry)
with a token service for its bearer auth (tokenauth); stopping such a server (processes).

May import: shardwise.crds, shardwise.operator, shardwise.e2e.localcluster
Never imports: torch
"""
