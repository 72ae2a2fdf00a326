"""Where weights come from and how a rank holds them: model sources and formats (HF safetensors,
GGUF, the built-in model) read slice by slice (loader, gguf_index), GGUF blocks kept as stored
(gguf_blocks), INT8 (quantize), layers streamed from host memory (offload), the tokenizer, and a
tiny random model for tests (tiny).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed
"""
