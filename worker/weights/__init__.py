"""Where weights come from and how a rank holds them: the model sources, each read slice by slice
(source: their interface; hf_source, gguf_source with gguf_index, checkpoint_source with
checkpoint_format: a training checkpoint's format and reading, checkpoint_metadata: DCP's index read
without unpickling code), the formats a `--model` may name
and the built-in model (formats, builtin), a rank's stage loading (loader), GGUF blocks kept as
stored (gguf_blocks) and the block-dot kernel that multiplies them on a CPU (block_dot, with its C++
source block_dot.cpp), INT8 (quantize), layers streamed from host memory (offload), the tokenizer,
and a tiny random model for tests (tiny).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed
"""
