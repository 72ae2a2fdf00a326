"""Parallelism and collectives for inference: tensor parallelism applied to the unchanged model
(tensor_parallel), the shared-memory all-reduce of a TP group on one host (shm_allreduce), and
where a CPU rank's weights sit in memory (placement: huge pages).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model
"""
