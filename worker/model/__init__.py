"""The model, free of parallelism: a Llama-family decoder (llama), its attention and KV cache
(attention), its mixture-of-experts feed-forward (moe), the Megatron split of its matrices that
tensor parallelism follows (splits) and its inference form of fused, transposed weights
(inference). Parallelism, quantization and the decode fast paths are applied from outside.

May import: shardwise.crds, shardwise.worker.errors
"""
