"""Training on PyTorch's own parallel stack: the trainer, DTensor/FSDP2 plans on a DeviceMesh
(parallelize), pipeline schedules (schedules), DCP checkpoints in tiers (checkpoint), gradient
compression (compression) and the step-keyed data order (data).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights
"""
