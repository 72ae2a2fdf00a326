"""Training on PyTorch's own parallel stack: the trainer and its run loop (trainer; options,
model_state, progress), DTensor/FSDP2 plans on a DeviceMesh (parallelize), each sequence split
over ranks with keys and values gathered in attention (context_parallel), pipeline schedules
(schedules), DCP checkpoints written and committed (checkpoint) in tiers (checkpoint_tiers), the shared tier in
an object store (checkpoint_s3, over DCP's writer and reader for S3: s3_storage),
gradient compression (compression; PowerSGD's low-rank mean: powersgd; its residuals in checkpoints: compression_state; AdamW with a
frozen variance after a dense warm-up: frozen_adam) and the step-keyed data order (data).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.fetch
"""
