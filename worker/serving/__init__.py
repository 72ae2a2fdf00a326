"""Inference: a rank's setup and local launch (rank), pipeline stages on torch.distributed (pipeline),
decode replayed as CUDA graphs (cuda_graphs) or compiled on CPU (fastpath), the engine that batches
requests (engine) over the paged KV cache's blocks (kv_blocks) and the model's view of them for
each step (cache_view), and the OpenAI-compatible HTTP API (http/). The engine's parts: what a
request asks and gets back (request), what runs next (scheduler, torch-free), the steps on the
stages (runner), and each row's next token (sampling).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights
"""
