"""The OpenAI-compatible HTTP API on rank 0 of a replica.

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.serving
"""
