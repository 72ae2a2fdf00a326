"""The operator's commands: `shardwise operator run` (run) and `shardwise plan` (plan).

May import: shardwise.crds, shardwise.operator.controller, shardwise.operator.decide, shardwise.operator.planning, shardwise.operator.render
"""
