"""`shardwise generate`: generate text with a model split over TP x PP local processes."""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by generate and serve: which model, how it is split, where it runs."""
    parser.add_argument("--model", required=True,
                        help="HF directory (config.json + .safetensors), a .gguf file, a training "
                             "checkpoint, or the built-in 'smollm2'")
    parser.add_argument("--tensor-parallel", "-t", type=int, default=1, metavar="T",
                        help="ranks per stage that split every layer's heads (default 1)")
    parser.add_argument("--pipeline-parallel", "-p", type=int, default=1, metavar="P",
                        help="pipeline stages, each owning a contiguous range of layers (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weights and activations (auto: float32 on cpu; on cuda the model's own "
                             "dtype, bfloat16 for a quantized GGUF or when unknown)")
    parser.add_argument("--max-seq-len", type=int, default=0,
                        help="KV cache length per request (default: the model's context, at most 4096)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank on cpu (default: cores/ranks)")
    parser.add_argument("--decode", choices=["auto", "eager", "graphs", "compile"], default="auto",
                        help="how decode steps run: eager; graphs (CUDA graphs, cuda only); compile "
                             "(torch.compile, replayed as CUDA graphs on cuda; on cpu compiles for "
                             "10-60 s per kind of step); auto: graphs on cuda, eager on cpu")
    parser.add_argument("--quantize", choices=["none", "int8", "gguf"], default="none",
                        help="int8: each rank keeps its decoder layers' weight matrices in INT8, one "
                             "scale per output row (embedding, LM head and norms stay in --dtype); "
                             "activations stay in --dtype; gguf: a GGUF file's Q8_0, Q4_0 and Q4_1 "
                             "layer matrices stay in their blocks, not dequantized (default none)")
    add_cache_arguments(parser)
    parser.add_argument("--offload-budget", default="0", metavar="SIZE",
                        help="bytes of weights each rank keeps on its device (e.g. 6GiB); the decoder "
                             "layers beyond it stay in host memory and stream in ahead of their turn, "
                             "decoding eagerly (default 0: every weight on the device)")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV cache's flags (engine.py): shared by generate, serve and worker."""
    parser.add_argument("--kv-cache-tokens", type=int, default=0, metavar="N",
                        help="tokens the KV cache holds, shared by all requests in blocks (default: "
                             "--max-batch x --max-seq-len, a whole context per request)")
    parser.add_argument("--kv-block-size", type=int, default=16, metavar="N",
                        help="tokens per KV-cache block: requests take blocks as they grow and share "
                             "the blocks of a common prompt prefix (default 16)")
    parser.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                        help="prompt tokens per prefill step; the running requests decode between "
                             "a long prompt's chunks (default 512)")


def cache_settings(args, kv_tokens: int = 0) -> dict:
    """RankSpec fields of add_cache_arguments' flags, checked; `kv_tokens` where the flag is not
    given (a pod: its ShardedModel's serving.kvCacheTokens, the tokens the planner sized it for)."""
    from shardwise.worker.errors import WorkerError
    for flag, value in (("--kv-cache-tokens", args.kv_cache_tokens), ("--kv-block-size", args.kv_block_size),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value < (0 if flag == "--kv-cache-tokens" else 1):
            raise WorkerError(f"{flag} must be {'>= 0' if flag == '--kv-cache-tokens' else 'at least 1'}, not {value}")
    return dict(kv_tokens=args.kv_cache_tokens or kv_tokens, kv_block=args.kv_block_size,
                prefill_chunk=args.prefill_chunk)


def spec_from_args(args):
    from shardwise.worker.weights.offload import parse_bytes
    from shardwise.worker.serving.rank import RankSpec
    # "auto" is resolved by runtime.validate, with the model's dtype: the rule the planner sizes by
    return RankSpec(model=args.model, tensor=args.tensor_parallel, pipeline=args.pipeline_parallel,
                    device=args.device, dtype=args.dtype, max_batch=args.max_batch, max_seq=args.max_seq_len,
                    threads=args.threads, decode=args.decode, quantize=args.quantize,
                    offload_budget=parse_bytes(args.offload_budget), **cache_settings(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message with the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token_ids, timings) as the last line")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    from shardwise.worker.errors import WorkerError
    try:
        return _run(args)
    except WorkerError as e:
        _say(f"shardwise generate: error: {e}")
        return 2


def _run(args) -> int:
    from shardwise.worker.serving.engine import Engine, Request
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.serving.rank import LocalRuntime, context_length, validate
    from shardwise.worker.weights.tokenizer import load_tokenizer

    spec = spec_from_args(args)
    if args.max_new_tokens < 1:
        raise WorkerError("--max-new-tokens must be at least 1")
    source = validate(spec)
    tokenizer = load_tokenizer(source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tokenizer.encode(text)
    cfg = source.config
    context = context_length(spec, cfg)
    if len(prompt_ids) >= context:
        raise WorkerError(f"prompt is {len(prompt_ids)} tokens; the context holds {context} "
                          f"(prompt plus at least one generated token)")
    _say(f"loading {args.model}: {cfg.num_layers} layers, {cfg.num_params / 1e6:.0f}M parameters, "
         f"{spec.tensor} x {spec.pipeline} ranks (tensor x pipeline) on {spec.device}, {spec.dtype}"
         + (f", {spec.quantize} weights" if spec.quantize != "none" else ""))
    t0 = time.perf_counter()
    runtime = LocalRuntime(spec, source)
    ctx = runtime.start()
    try:
        load_s = time.perf_counter() - t0
        _say(f"loaded in {load_s:.1f}s; weight bytes per rank: "
             + ", ".join(f"{r['weight_bytes'] / 2**20:.1f} MiB" for r in ctx.loaded))
        engine = Engine.for_rank(ctx, tokenizer.eos_ids, rows=1)
        req = Request(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, seed=args.seed)
        engine.check(req)
        printed = ""

        def stream(r: Request, _token: int) -> None:
            nonlocal printed
            if args.json:
                return
            now = tokenizer.decode(r.token_ids)
            if not now.endswith("\ufffd"):        # wait for the rest of a multi-byte character
                sys.stdout.write(now[len(printed):])
                sys.stdout.flush()
                printed = now

        req.on_token = stream
        t1 = time.perf_counter()
        engine.generate([req])
        total = time.perf_counter() - t1
    finally:
        runtime.stop()
    out = tokenizer.decode(req.token_ids)
    decode_s = (req.finished_at or t1) - (req.first_token_at or t1)
    decode_tps = (len(req.token_ids) - 1) / decode_s if decode_s > 0 and len(req.token_ids) > 1 else 0.0
    if args.json:
        print(json.dumps({"text": out, "token_ids": req.token_ids, "prompt_token_ids": prompt_ids,
                          "finish_reason": req.finish_reason, "tensor_parallel": spec.tensor,
                          "pipeline_parallel": spec.pipeline, "load_seconds": round(load_s, 3),
                          "generate_seconds": round(total, 3),
                          "decode_tokens_per_second": round(decode_tps, 2),
                          "weight_bytes_per_rank": [r["weight_bytes"] for r in ctx.loaded]}))
    else:
        sys.stdout.write(out[len(printed):] + "\n")
        _say(f"{len(req.token_ids)} tokens in {total:.2f}s ({decode_tps:.1f} tokens/s decode), "
             f"finish: {req.finish_reason}")
    return 0
