"""The model, free of parallelism: a Llama-family decoder (llama) and its mixture-of-experts
feed-forward (moe). Parallelism, quantization and the decode fast paths are applied from outside.

May import: shardwise.crds, shardwise.worker.errors
"""
