"""The flags the worker's commands share: which model, how it is split, where it runs, how it serves.

Each flag is defined here once; `shardwise generate` and `serve` take the whole set
(`add_model_arguments`), a pod (`shardwise worker`) the ones that are not in its contract, and
`shardwise train` the layout and the device.

The serving settings (batch, sequence length, threads, the KV cache's size, block and prefill
chunk, decode mode, waiting queue) default to None here: a flag not given leaves the field to the
pod contract's value (`shardwise worker`: the settings its plan sized, crds/capacity.py) or else to
RankSpec's own default (worker/serving/rank.py), which takes it from crds/capacity.py, the one
definition of each; the help states it from there too. A flag given wins over both. Nothing here
imports torch, so `--help` answers at once and works where torch is not installed.
"""
from __future__ import annotations

import argparse

from shardwise.crds.modelshape import BLOCK_ACTIVATIONS, BlockActivations
from shardwise.worker.serving import defaults

DECODE_MODES = [m.value for m in defaults.DecodeMode]
QUANTIZATIONS = ["none", "int8", "gguf"]

# flag's attribute -> RankSpec field, for the flags whose default is RankSpec's (or a contract's)
SPEC_FIELDS = {"max_batch": "max_batch", "max_seq_len": "max_seq", "threads": "threads",
               "kv_cache_tokens": "kv_tokens", "kv_block_size": "kv_block", "prefill_chunk": "prefill_chunk",
               "decode": "decode", "max_step_tokens": "max_step_tokens"}
# what a pod's contract says of where its flags are not given
IN_A_POD = "; `shardwise worker`: its contract's"


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
    parser.add_argument("--block-activations", choices=[a.value for a in BlockActivations],
                        default=BLOCK_ACTIVATIONS.value,
                        help="--quantize gguf on a CPU: how the block-dot kernel quantizes each "
                             "matrix's input per block of 32; fine: 14 bits (more precise than "
                             "bfloat16), int8: llama.cpp's 8 bits, faster, slightly worse text "
                             f"(default {BLOCK_ACTIVATIONS.value})")
    add_cache_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument("--offload-budget", default="0", metavar="SIZE",
                        help="bytes of weights each rank keeps on its device (e.g. 6GiB); the decoder "
                             "layers beyond it stay in host memory and stream in ahead of their turn, "
                             "decoding eagerly (default 0: every weight on the device)")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """Requests decoded together and the context of each (generate, serve, worker)."""
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="context per request, prompt and completion (default: the model's context, at most "
                             f"{defaults.DEFAULT_CONTEXT}{IN_A_POD})")
    parser.add_argument("--max-batch", type=int, default=None,
                        help=f"requests decoded together (default {defaults.MAX_BATCH}{IN_A_POD})")


def add_waiting_argument(parser: argparse.ArgumentParser) -> None:
    """The bound of the engine's waiting queue (serve, worker)."""
    parser.add_argument("--max-waiting", type=_positive, default=None, metavar="N",
                        help="choices queued for a free row at most (a request of n choices counts n); a "
                             "request beyond it is refused at once with 429 and Retry-After (default "
                             f"{defaults.WAITING_PER_ROW} x --max-batch, at least {defaults.MIN_WAITING}{IN_A_POD})")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def add_decode_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode", choices=DECODE_MODES, default=None,
                        help="how decode steps run: eager; graphs (CUDA graphs, cuda only); compile "
                             "(torch.compile, replayed as CUDA graphs on cuda; on cpu compiles for "
                             f"10-60 s per kind of step); auto: graphs on cuda, eager on cpu (default auto{IN_A_POD})")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV cache's flags (engine.py): shared by generate, serve and worker."""
    parser.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                        help="tokens the KV cache holds, shared by all requests in blocks (default 0: "
                             f"--max-batch x --max-seq-len, a whole context per request{IN_A_POD})")
    parser.add_argument("--kv-block-size", type=int, default=None, metavar="N",
                        help="tokens per KV-cache block: requests take blocks as they grow and share "
                             f"the blocks of a common prompt prefix (default {defaults.KV_BLOCK_SIZE}{IN_A_POD})")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prompt tokens of one request per step; the running requests decode "
                             f"in every step, a long prompt's chunks included (default {defaults.PREFILL_CHUNK}{IN_A_POD})")
    parser.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                        help="tokens per step: every running request's next token, then prompt chunks of "
                             "as many waiting requests as fit, in one forward; at least --max-batch + 1 "
                             f"is used (default {defaults.MAX_STEP_TOKENS})")


def add_speculative_arguments(parser: argparse.ArgumentParser, pod: bool = False) -> None:
    """Speculative decoding's flags (worker/serving/speculative.py): serve, generate and worker; a
    pod's defaults are its ShardedModel's serving.speculative."""
    from shardwise.crds.speculative import (DRAFT_TOKENS, DRAFT_TOKENS_MAX, NGRAM_LIMIT, NGRAM_MAX, NGRAM_MIN,
                                            SpeculativeMethod)

    def of(default) -> str:
        return "spec.serving.speculative" if pod else str(default)

    parser.add_argument("--speculative", choices=[m.value for m in SpeculativeMethod], default=None,
                        help="ngram: greedy requests take drafts copied from where their last tokens "
                             "occurred earlier in prompt or output, several verified per step "
                             f"(prompt lookup, no second model; default {of(SpeculativeMethod.NONE.value)})")
    parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                        help=f"drafts per request and step, 1 to {DRAFT_TOKENS_MAX} (default {of(DRAFT_TOKENS)})")
    parser.add_argument("--ngram", default=None, metavar="MIN:MAX",
                        help=f"n-gram lengths looked up, longest first, within 1..{NGRAM_LIMIT} "
                             f"(default {of(f'{NGRAM_MIN}:{NGRAM_MAX}')})")


def speculative_setting(args, spec=None):
    """The SpeculativeConfig of the speculative flags given over `spec` (a crds Speculative: a
    pod's serving.speculative; None: the spec's defaults); None when not speculating."""
    from shardwise.crds.speculative import Speculative, SpeculativeMethod
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.serving.speculative import SpeculativeConfig
    spec = spec if spec is not None else Speculative()
    method = getattr(args, "speculative", None) or spec.method.value
    if method == SpeculativeMethod.NONE.value:
        return None
    low, high = spec.ngram_min, spec.ngram_max
    if getattr(args, "ngram", None) is not None:
        try:
            low, high = (int(v) for v in args.ngram.split(":"))
        except ValueError:
            raise WorkerError(f"--ngram must be MIN:MAX (two integers), not {args.ngram!r}") from None
    tokens = getattr(args, "draft_tokens", None)
    return SpeculativeConfig(spec.draft_tokens if tokens is None else tokens, low, high)


def serving_settings(args, planned: dict | None = None, speculative=None) -> dict:
    """RankSpec fields of the batch, thread, cache, decode and speculative flags given, checked, over
    `planned` (a pod: the settings of its contract, as RankSpec fields): a flag given wins; a field
    neither gives is left out, so RankSpec's default applies. `speculative`: a pod's
    serving.speculative, under the speculative flags."""
    from shardwise.worker.errors import WorkerError
    for flag, value in (("--kv-cache-tokens", args.kv_cache_tokens), ("--kv-block-size", args.kv_block_size),
                        ("--prefill-chunk", args.prefill_chunk), ("--max-batch", args.max_batch),
                        ("--max-step-tokens", getattr(args, "max_step_tokens", None))):
        if value is not None and value < (0 if flag == "--kv-cache-tokens" else 1):
            raise WorkerError(f"{flag} must be {'>= 0' if flag == '--kv-cache-tokens' else 'at least 1'}, not {value}")
    given = {field: getattr(args, flag) for flag, field in SPEC_FIELDS.items()
             if getattr(args, flag, None) is not None}
    drafts = speculative_setting(args, speculative)
    return {**(planned or {}), **given, **({"speculative": drafts} if drafts is not None else {})}


def spec_from_args(args):
    """The RankSpec of generate's and serve's flags."""
    from shardwise.worker.weights.offload import parse_bytes
    from shardwise.worker.serving.rank import RankSpec
    # "auto" is resolved by runtime.validate, with the model's dtype: the rule the planner sizes by
    return RankSpec(model=args.model, tensor=args.tensor_parallel, pipeline=args.pipeline_parallel,
                    device=args.device, dtype=args.dtype, quantize=args.quantize,
                    block_activations=args.block_activations,
                    offload_budget=parse_bytes(args.offload_budget), **serving_settings(args))
