"""The worker: what a ShardedModel's pods run, and `shardwise generate|serve|train` on one machine.

    model/        the unchanged Llama-family model and mixture-of-experts layer
    distributed/  tensor parallelism applied from outside, collectives
    weights/      model sources and formats, sliced loading, quantization, offload, tokenizer
    fetch/        a model fetched from hf://, s3:// or oci:// into the node-local cache (no torch)
    serving/      inference: rank setup, pipeline stages, the engine, KV blocks, the HTTP API (http/)
    training/     training on FSDP2 x DTensor TP x pipelining, schedules, checkpoints, compression, data
    cli/          `shardwise generate`, `serve`, `train` and `worker` (one pod)

May import: shardwise.crds
Never imports: kopf, kubernetes
"""
