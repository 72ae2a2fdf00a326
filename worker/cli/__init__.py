"""The worker's commands: `shardwise generate`, `serve`, `train` and `worker` (what one pod runs).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.serving, shardwise.worker.training
"""
