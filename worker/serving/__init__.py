"""Inference: a rank's setup and local launch (rank), pipeline stages on torch.distributed (pipeline),
decode replayed as CUDA graphs (cuda_graphs), the engine that batches requests (engine: the loop over
the scheduler's decisions (scheduler), the steps run on the stages (runner), next-token sampling
(sampling) and the requests (request)) over the paged KV cache's blocks (kv_blocks), and the
OpenAI-compatible HTTP API (http/).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights
"""
