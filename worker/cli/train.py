"""`shardwise train`: train a model under TP x PP x DP x CP on local processes, with sharded checkpoints.

Without torchrun variables, this command starts T*P*D*C local processes (gloo on CPU, NCCL on
CUDA), each running `run_training` as one rank, and watches them as one group: if any rank dies,
the others are stopped and the command fails; running it again resumes from the latest complete
checkpoint (in whatever layout is asked this time). Under torchrun (RANK/WORLD_SIZE set) it runs
just that rank.

SIGINT or SIGTERM to the command is passed on to the ranks, which finish their step, agree on the
step to stop at, save a shared checkpoint there and exit 128 + the signal; the command waits for
them (a second signal stops them at once) and exits with that status.
"""
from __future__ import annotations

import argparse
import os
import sys

from shardwise.crds import names
from shardwise.crds.training import DEFAULT_PRECISION, Precision
from shardwise.worker.cli.flags import add_device_argument, add_layout_arguments
from shardwise.worker.fetch.s3 import S3Config
from shardwise.worker.distributed.launch import (Ending, Exit, Outcome, Policy, forkserver, stop_forkserver,
                                                 stopped_by, supervise)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model folder, .gguf file, or a training checkpoint")
    p.add_argument("--data", required=True, help="UTF-8 text file to train on")
    add_layout_arguments(p)
    _add_parallel_arguments(p)
    p.add_argument("--compression", default="none", choices=list(names.COMPRESSION_METHODS),
                   help="compress gradients averaged across the D/S replicate groups (error feedback keeps "
                        "convergence)")
    p.add_argument("--compression-density", type=float, default=0.01, metavar="F",
                   help="topk, topk-int4: fraction of gradient elements sent, in (0, 1]")
    p.add_argument("--compression-rank", type=int, default=names.POWERSGD_DEFAULT_RANK, metavar="R",
                   help=f"powersgd: rank of each gradient matrix's approximation, 1 to "
                        f"{names.POWERSGD_MAX_RANK} (default {names.POWERSGD_DEFAULT_RANK})")
    p.add_argument("--compression-warmup", type=int, default=0, metavar="N",
                   help="the first N steps dense with plain AdamW, then compressed with AdamW's variance "
                        "frozen (what keeps top-k's loss; 0: compressed from the first step, plain AdamW)")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    p.add_argument("--checkpoint-dir", required=True, help="where checkpoints go; a run resumes from here")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    _add_store_arguments(p)
    p.add_argument("--local-checkpoint-dir", default=None, metavar="DIR",
                   help="node-local tier: every --local-checkpoint-every steps each rank saves its own state "
                        "here (no collective; resumed from only in the same layout, when newer than the "
                        "newest --checkpoint-dir checkpoint)")
    p.add_argument("--local-checkpoint-every", type=int, default=0, metavar="K",
                   help="local-tier interval in steps (steps that save to --checkpoint-dir are skipped)")
    p.add_argument("--local-keep", type=int, default=2, metavar="K", help="local checkpoints kept per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm limit (0: off)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all replicas")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=0,
                   help="pipeline micro-batches per replica (default: the largest divisor of the per-replica batch up to twice the pipeline degree)")
    add_device_argument(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 on cpu; on cuda the model's own dtype (bfloat16 for a quantized GGUF)")
    p.add_argument("--precision", default=DEFAULT_PRECISION.value, choices=[x.value for x in Precision],
                   help="the decoder blocks' linear layers: default (in --dtype) or fp8 (float8 matmuls, torchao's "
                        "tensorwise recipe; embedding, head and norms stay in --dtype; use with --dtype bfloat16)")
    p.add_argument("--sync-checkpoint", action="store_true",
                   help="write checkpoints in the training thread (default: in the background)")
    p.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank on cpu (default: cores/ranks)")


def _add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """How the work is split and scheduled beyond tensor x pipeline: data and context parallel, FSDP2."""
    p.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="replicas that each take a share of the batch and average gradients")
    p.add_argument("--data-shard", type=int, default=0, metavar="S",
                   help="ZeRO-3: shard parameters, gradients and optimizer state over S of the D replicas "
                        "(D/S such groups average their gradients); default: all D")
    p.add_argument("--schedule", default="1F1B", choices=["1F1B", "GPipe", "Interleaved1F1B"],
                   help="pipeline schedule when --pipeline-parallel > 1")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward instead of keeping them")
    p.add_argument("--prefetch-depth", type=int, default=0, metavar="K",
                   help="FSDP2: each block all-gathers the parameters of the next K blocks (the previous K in "
                        "backward) before it computes; 0 (default): FSDP2's own order")
    p.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="context parallelism: split each sequence over C ranks (per data-parallel replica), "
                        "which attend over the keys and values of the whole sequence; the sequence length must "
                        "be a multiple of 2C")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel > 1: split the norms and the activations between blocks over the "
                        "sequence as well (each rank keeps 1/T of them)")


def _add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The shared tier in an object store instead of --checkpoint-dir."""
    p.add_argument("--checkpoint-uri", default=None, metavar="s3://BUCKET/PREFIX",
                   help="keep the shared checkpoints in this S3-compatible object store instead of "
                        "--checkpoint-dir (which then holds progress.json only); credentials from "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    p.add_argument("--checkpoint-endpoint", default=None, metavar="URL",
                   help="the store's endpoint, e.g. http://minio.storage:9000 (default: AWS S3)")
    p.add_argument("--checkpoint-region", default=S3Config().region, help="the store's region")
    p.add_argument("--checkpoint-path-style", action="store_true",
                   help="bucket in the URL path, not the host name (MinIO, most on-premises stores)")


def options(args):
    from shardwise.worker.training.trainer import TrainOptions
    return TrainOptions(
        model=args.model, data=args.data, checkpoint_dir=args.checkpoint_dir, steps=args.steps,
        tensor=args.tensor_parallel, pipeline=args.pipeline_parallel, context=args.context_parallel,
        data_parallel=args.data_parallel,
        data_shard=args.data_shard, schedule=args.schedule, activation_checkpointing=args.activation_checkpointing,
        sequence_parallel=args.sequence_parallel, prefetch_depth=args.prefetch_depth,
        compression=args.compression, compression_density=args.compression_density,
        compression_rank=args.compression_rank,
        compression_warmup=args.compression_warmup,
        checkpoint_every=args.checkpoint_every, keep=args.keep, checkpoint_uri=args.checkpoint_uri,
        checkpoint_s3=S3Config(endpoint=args.checkpoint_endpoint, region=args.checkpoint_region,
                               path_style=args.checkpoint_path_style), local_checkpoint_dir=args.local_checkpoint_dir,
        local_every=args.local_checkpoint_every, local_keep=args.local_keep, seed=args.seed, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        batch_size=args.batch_size, seq_len=args.seq_len, micro_batches=args.micro_batches,
        device=args.device, dtype=args.dtype, precision=Precision(args.precision), async_checkpoint=not args.sync_checkpoint, json=args.json)


def check_inputs(opts, local_dir_name: str = "--local-checkpoint-dir") -> None:
    """Everything that can be checked before starting processes, each failure one clear line.
    `local_dir_name` is what the message calls the local checkpoint directory (a pod: the spec field)."""
    from shardwise.worker.fetch.remote import RemoteError
    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.worker.training.data import TokenDataset
    from shardwise.worker.training.options import precision_problem, shared_store
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.weights.loader import check_layout, open_model
    from shardwise.worker.weights.tokenizer import load_tokenizer

    flag = {"tensor": "tensor-parallel", "pipeline": "pipeline-parallel", "context": "context-parallel"}
    for name in ("steps", "tensor", "pipeline", "context", "data_parallel", "batch_size", "seq_len"):
        if getattr(opts, name) < 1:
            raise WorkerError(f"--{flag.get(name, name.replace('_', '-'))} must be at least 1")
    if opts.checkpoint_every < 0 or opts.keep < 1:
        raise WorkerError("--checkpoint-every must be >= 0 and --keep >= 1")
    if opts.data_shard < 0:
        raise WorkerError("--data-shard must be at least 1 (or 0: all of --data-parallel)")
    if opts.local_every < 0 or opts.local_keep < 1:
        raise WorkerError("--local-checkpoint-every must be >= 0 and --local-keep >= 1")
    if bool(opts.local_checkpoint_dir) != (opts.local_every > 0):
        raise WorkerError("--local-checkpoint-dir and --local-checkpoint-every K (K >= 1) go together")
    if opts.local_checkpoint_dir:
        try:
            ckpt.check_writable(opts.local_checkpoint_dir)
        except OSError as e:
            raise WorkerError(f"{local_dir_name} {opts.local_checkpoint_dir} is not writable: "
                              f"{e.strerror or e}") from None
    source = open_model(opts.model)
    check_layout(source.config, opts.tensor, opts.pipeline)
    problem = opts.problem(source.config.num_layers) or precision_problem(opts, source.config)
    if problem:
        raise WorkerError(problem)
    if opts.compression != "none" and opts.shard == opts.data_parallel:
        # (A pod just runs uncompressed: the operator may have shrunk the job to one group.)
        raise WorkerError(f"gradient compression works across replicate groups: --data-shard {opts.shard} "
                          f"leaves none of the {opts.data_parallel} replicas (use a shard degree below "
                          f"{opts.data_parallel})")
    TokenDataset.from_file(opts.data, load_tokenizer(source).encode)  # readable, non-empty, tokenizable
    if os.path.exists(opts.checkpoint_dir) and not os.path.isdir(opts.checkpoint_dir):
        raise WorkerError(f"--checkpoint-dir {opts.checkpoint_dir} exists and is not a directory")
    store = shared_store(opts)
    try:
        newest = ckpt.newest_in(store)   # an object store: also whether it answers, with these credentials
    except (RemoteError, ckpt.CheckpointError) as e:   # listing the store failed (a folder's never does)
        raise WorkerError(f"--checkpoint-uri: {e}") from None
    if newest is not None:
        ckpt.check_same_model(newest[1].get("model", {}), ckpt.structure_of(source.config.to_dict()),
                              store.where(newest[0]))


def _rank_main(opts, rank: int, world: int, port: int, threads: int | None = None) -> None:
    """One local rank: named `shardwise-rk<N>` in ps/top; only rank 0 prints to stdout."""
    import torch

    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.worker.training.data import DataError
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.training.trainer import run_training

    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"shardwise-rk{rank}")
    except OSError:
        pass
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    if rank != 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    try:
        code = run_training(opts, rank, world)
    except (WorkerError, DataError, ckpt.CheckpointError) as e:
        if rank == 0:
            print(f"shardwise train: {e}", file=sys.stderr, flush=True)
        code = Exit.BAD_INPUT
    sys.stdout.flush()
    os._exit(code)


# How a local group of ranks is watched: the signal received goes on to them; a second one stops
# them at once; a failed rank stops the others, after a moment in which a rank killed by a signal
# takes its peers down (their collectives fail), so that the killed one is reported as the cause.
LOCAL_GROUP = Policy(second_signal_aborts=True, settle_s=0.5, poll_s=0.05)


def launch(opts, world: int, threads: int | None = None, ctx=None) -> int:
    """Run `world` local ranks of `opts`; if one fails, stop the others (the group is one unit).

    SIGINT/SIGTERM are forwarded to the ranks, which stop together after a shared checkpoint:
    the launcher waits for all of them and returns their status (130/143). A second signal
    stops them at once."""
    from shardwise.worker.serving.rank import free_port
    port = free_port()
    ctx = ctx or rank_server()

    def start() -> list:
        procs = [ctx.Process(target=_rank_main, args=(opts, rank, world, port, threads), name=f"rank{rank}")
                 for rank in range(world)]
        for p in procs:
            p.start()
        return procs
    return status_of(supervise(start, LOCAL_GROUP))


def rank_server(start: bool = False):
    """The fork server the local ranks start from, with the training code imported."""
    return forkserver("shardwise.worker.training.trainer", start)


def status_of(outcome: Outcome) -> int:
    """0 when all finished; their stop status (130/143) when a signal stopped them at an agreed
    step; 1 (or 128 + signal) when one failed or a second signal came."""
    if outcome.ending is Ending.ABORTED:
        return stopped_by(outcome.signals[0])
    if outcome.ending is Ending.FAILED:
        rank, code = min(outcome.failed, key=lambda rc: (rc[1] >= 0, rc[0]))
        if code < 0:
            print(f"shardwise train: rank {rank} was killed by signal {-code}; stopping the other "
                  f"ranks (run again to resume from the last complete checkpoint)", file=sys.stderr)
            return Exit.FAILED
        return code
    # Stopped together at an agreed step (or all done, the stop having come at the last step).
    return outcome.stop_status


def run(args) -> int:
    in_group = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # The ranks' fork server first: its seconds of importing torch and the training code overlap
    # this process's own imports and checks.
    ctx = rank_server(start=True) if not in_group and (args.threads is None or args.threads >= 1) else None
    from shardwise.worker.training import checkpoint as ckpt
    from shardwise.worker.training.data import DataError
    from shardwise.worker.errors import WorkerError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # ranks are forked after tokenizing
    opts = options(args)
    try:
        if not in_group:
            if args.threads is not None and args.threads < 1:
                raise WorkerError("--threads must be at least 1")
            check_inputs(opts)
            return launch(opts, opts.world_size, args.threads, ctx)
        from shardwise.worker.training.trainer import run_training
        return run_training(opts)
    except (WorkerError, DataError, ckpt.CheckpointError) as e:
        if not in_group or os.environ.get("RANK") == "0":
            print(f"shardwise train: {e}", file=sys.stderr)
        if ctx is not None:
            stop_forkserver()      # no rank will come: the answer is not held up by its import
        return Exit.BAD_INPUT
