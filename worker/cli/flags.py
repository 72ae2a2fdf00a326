"""The flags the worker's commands share: which model, how it is split, where it runs, how it serves.

Each flag is defined here once; `shardwise generate` and `serve` take the whole set
(`add_model_arguments`), a pod (`shardwise worker`) the ones that are not in its contract, and
`shardwise train` the layout and the device.

The serving numbers (batch, sequence length, threads, the KV cache's size, block and prefill chunk)
default to None here: a flag not given leaves the field to RankSpec's own default
(worker/serving/rank.py), which takes it from worker/serving/defaults.py, the one definition of
each; the help states it from there too. Nothing here imports torch, so `--help` answers at once and
works where torch is not installed.
"""
from __future__ import annotations

import argparse

from shardwise.worker.serving import defaults

DECODE_MODES = ["auto", "eager", "graphs", "compile"]
QUANTIZATIONS = ["none", "int8", "gguf"]

# flag's attribute -> RankSpec field, for the flags whose default is RankSpec's
SPEC_FIELDS = {"max_batch": "max_batch", "max_seq_len": "max_seq", "threads": "threads",
               "kv_block_size": "kv_block", "prefill_chunk": "prefill_chunk",
               "max_step_tokens": "max_step_tokens"}


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor x pipeline degrees (generate, serve, train)."""
    parser.add_argument("--tensor-parallel", "-t", type=int, default=1, metavar="T",
                        help="ranks per stage that split every layer's heads (default 1)")
    parser.add_argument("--pipeline-parallel", "-p", type=int, default=1, metavar="P",
                        help="pipeline stages, each owning a contiguous range of layers (default 1)")


def add_device_argument(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """`auto` (a pod): cuda when torch sees a GPU, else cpu."""
    if auto:
        parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    else:
        parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by generate and serve: which model, how it is split, where it runs."""
    parser.add_argument("--model", required=True,
                        help="HF directory (config.json + .safetensors), a .gguf file, a training "
                             "checkpoint, or the built-in 'smollm2'")
    add_layout_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weights and activations (auto: float32 on cpu; on cuda the model's own "
                             "dtype, bfloat16 for a quantized GGUF or when unknown)")
    add_batch_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank on cpu (default: cores/ranks)")
    add_decode_argument(parser)
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default="none",
                        help="int8: each rank keeps its decoder layers' weight matrices in INT8, one "
                             "scale per output row (embedding, LM head and norms stay in --dtype); "
                             "activations stay in --dtype; gguf: a GGUF file's Q8_0, Q4_0 and Q4_1 "
                             "layer matrices stay in their blocks, not dequantized (default none)")
    add_cache_arguments(parser)
    parser.add_argument("--offload-budget", default="0", metavar="SIZE",
                        help="bytes of weights each rank keeps on its device (e.g. 6GiB); the decoder "
                             "layers beyond it stay in host memory and stream in ahead of their turn, "
                             "decoding eagerly (default 0: every weight on the device)")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """Requests decoded together and the context of each (generate, serve, worker)."""
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="KV cache length per request (default: the model's context, at most 4096)")
    parser.add_argument("--max-batch", type=int, default=None, help=f"requests decoded together (default {defaults.MAX_BATCH})")


def add_decode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode", choices=DECODE_MODES, default="auto",
                        help="how decode steps run: eager; graphs (CUDA graphs, cuda only); compile "
                             "(torch.compile, replayed as CUDA graphs on cuda; on cpu compiles for "
                             "10-60 s per kind of step); auto: graphs on cuda, eager on cpu")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV cache's flags (engine.py): shared by generate, serve and worker."""
    parser.add_argument("--kv-cache-tokens", type=int, default=0, metavar="N",
                        help="tokens the KV cache holds, shared by all requests in blocks (default: "
                             "--max-batch x --max-seq-len, a whole context per request)")
    parser.add_argument("--kv-block-size", type=int, default=None, metavar="N",
                        help="tokens per KV-cache block: requests take blocks as they grow and share "
                             f"the blocks of a common prompt prefix (default {defaults.KV_BLOCK_SIZE})")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prompt tokens of one request per step; the running requests decode "
                             f"in every step, a long prompt's chunks included (default {defaults.PREFILL_CHUNK})")
    parser.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                        help="tokens per step: every running request's next token, then prompt chunks of "
                             "as many waiting requests as fit, in one forward; at least --max-batch + 1 "
                             f"is used (default {defaults.MAX_STEP_TOKENS})")


def serving_settings(args, kv_tokens: int = 0) -> dict:
    """RankSpec fields of the batch, thread and cache flags given, checked; `kv_tokens` where
    --kv-cache-tokens is not given (a pod: its ShardedModel's serving.kvCacheTokens, the tokens the
    planner sized it for). A flag not given is left out: RankSpec's default applies."""
    from shardwise.worker.errors import WorkerError
    for flag, value in (("--kv-cache-tokens", args.kv_cache_tokens), ("--kv-block-size", args.kv_block_size),
                        ("--prefill-chunk", args.prefill_chunk),
                        ("--max-step-tokens", getattr(args, "max_step_tokens", None))):
        if value is not None and value < (0 if flag == "--kv-cache-tokens" else 1):
            raise WorkerError(f"{flag} must be {'>= 0' if flag == '--kv-cache-tokens' else 'at least 1'}, not {value}")
    settings = {field: getattr(args, flag) for flag, field in SPEC_FIELDS.items()
                if getattr(args, flag, None) is not None}
    return dict(settings, kv_tokens=args.kv_cache_tokens or kv_tokens)


def spec_from_args(args):
    """The RankSpec of generate's and serve's flags."""
    from shardwise.worker.weights.offload import parse_bytes
    from shardwise.worker.serving.rank import RankSpec
    # "auto" is resolved by runtime.validate, with the model's dtype: the rule the planner sizes by
    return RankSpec(model=args.model, tensor=args.tensor_parallel, pipeline=args.pipeline_parallel,
                    device=args.device, dtype=args.dtype, decode=args.decode, quantize=args.quantize,
                    offload_budget=parse_bytes(args.offload_budget), **serving_settings(args))
