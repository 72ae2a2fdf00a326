"""`shardwise demo`'s run: the ShardedModel it applies and how its progress reads (model), and its
steps against a local cluster with their teardown (steps). The command itself is shardwise.e2e.cli.demo.

May import: shardwise.crds, shardwise.operator, shardwise.e2e.build, shardwise.e2e.localcluster
"""
