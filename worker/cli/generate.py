"""`shardwise generate`: generate text with a model split over TP x PP local processes."""
from __future__ import annotations

import argparse
import json
import sys
import time

from shardwise.worker.cli.flags import add_model_arguments, spec_from_args
from shardwise.worker.distributed.launch import Exit


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
        return Exit.BAD_INPUT


def _run(args) -> int:
    from shardwise.worker.serving.rank import LocalRuntime

    spec, source, tokenizer, prompt_ids = _prepare(args)
    t0 = time.perf_counter()
    runtime = LocalRuntime(spec, source)
    ctx = runtime.start()
    try:
        load_s = time.perf_counter() - t0
        _say(f"loaded in {load_s:.1f}s; weight bytes per rank: "
             + ", ".join(f"{r['weight_bytes'] / 2**20:.1f} MiB" for r in ctx.loaded))
        req, printed, t1, total = _generate(args, ctx, tokenizer, prompt_ids)
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
    return Exit.OK


def _prepare(args):
    """The spec, the model's source, its tokenizer and the prompt's ids, checked before any rank
    starts; says what is about to load."""
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.serving.rank import context_length, validate
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
    return spec, source, tokenizer, prompt_ids


def _generate(args, ctx, tokenizer, prompt_ids):
    """Generate on the loaded ranks, streaming the text to stdout unless --json. Returns the
    request, the text printed so far, when generation began and how long it took."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request

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
    return req, printed, t1, time.perf_counter() - t1
