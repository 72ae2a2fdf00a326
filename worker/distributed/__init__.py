"""Parallelism and collectives for inference: tensor parallelism applied to the unchanged model
(tensor_parallel) and the shared-memory all-reduce of a TP group on one host (shm_allreduce).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model
"""
