"""The local clusters' commands: `shardwise dev` (dev), `shardwise demo` (demo), `shardwise kind` (kind).

May import: shardwise.crds, shardwise.operator, shardwise.e2e.build, shardwise.e2e.demo, shardwise.e2e.localcluster, shardwise.e2e.kind, shardwise.e2e.pytest_plugin, shardwise.e2e.readme, shardwise.e2e.s3server
"""
