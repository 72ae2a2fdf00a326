"""Parallelism and collectives for inference: tensor parallelism applied to the unchanged model
(tensor_parallel), the shared-memory all-reduce of a TP group on one host (shm_allreduce), where a
CPU rank's weights sit in memory (placement: huge pages), and the supervisor of a group of rank
processes with the exit statuses of the worker's commands (launch).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model
"""
