"""`shardwise worker`: what one ShardedModel pod runs (one pipeline stage of one replica).

    shardwise worker --contract /etc/shardwise/contract.json.gz     (or a plain contract.json)
    env: SHARDWISE_REPLICA, SHARDWISE_STAGE   which placement of the plan this pod is (--replica/--stage)
         MASTER_ADDR, MASTER_PORT             rendezvous (the world's stage-0 pod)
         POD_IP                               a loopback POD_IP is the address to bind (--host overrides)

A remote model (the contract's `source`: hf://, s3://, oci://) is fetched first, only this stage's
files, into the contract's cache folder, with GET /download (crds/download.py DownloadReport) on the
port meanwhile (worker/cli/pod_fetch.py); the ranks then load that folder as a model in a path, and
whichever server holds the port next (rank 0's API, or the pod's own /healthz server) answers GET
/download with the fetch's final report for the pod's life: the operator reads it however short the
fetch was (it posts one Downloaded Event per replica attempt).

The contract (crds/contract.py, written by the operator into the model's ConfigMap) is everything
the pods of a model share: the plan, the model's path and dtype, the workload, the serving port and
name, the serving settings (sequences at once, context, KV cache and block, prefill chunk, decode
mode, waiting queue: what the planner sized; a flag given here wins), the training and checkpoint
options, the termination-log path. The environment says which pod
this is. The file is plain JSON or gzip-compressed JSON (the operator's; told apart by gzip's magic
bytes), inflated to at most 64 MiB. A missing, invalid or oversized contract is one line on stderr
and exit status 2.

The pod process reads the contract, then starts one process per TP rank (plan.tensor of them),
ranked by crds/layout.py RankLayout (a replica is its own world), and supervises them: if
one dies the pod exits non-zero so the operator sees it. On stage 0, global rank 0 serves the
OpenAI API, /healthz (200 once every rank of the replica has loaded) and /metrics on the contract's
port. On other stages the pod process serves /healthz (200 once its own ranks have loaded) and
/metrics (its ranks' weight bytes) on that port.

With workload training the ranks train instead (worker/training/trainer.py, options from the contract): one
world over every replica (RankLayout with the replicas counted). Every pod serves
/healthz (200 once its ranks have joined and resumed) and /progress (the job's progress.json from the
shared checkpoint directory); when every step is done the pod writes the result to the contract's
termination log and exits 0. SIGTERM to a training pod (deleted, drained, preempted) is forwarded to
its ranks, which finish their step, stop at a step every rank agrees on, save a shared checkpoint
there and exit 143; the pod waits for them (within its grace period) and exits 143 too.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

from shardwise.crds import names
from shardwise.crds.models import Workload
from shardwise.worker.cli.flags import (QUANTIZATIONS, add_batch_arguments, add_cache_arguments,
                                        add_decode_argument, add_device_argument, add_speculative_arguments,
                                        add_waiting_argument)
from shardwise.worker.cli.pod_health import StageHealth
from shardwise.worker.distributed.launch import Ending, Exit, Policy, stop_on_signals, supervise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contract", required=True, metavar="PATH",
                        help=f"pod contract, JSON or gzip-compressed JSON (the operator mounts {names.CONTRACT_PATH})")
    parser.add_argument("--host", default=None,
                        help="address to bind (default: $POD_IP when it is a loopback address, else 0.0.0.0)")
    parser.add_argument("--replica", type=int, default=None, help=f"default: ${names.ENV_REPLICA}")
    parser.add_argument("--stage", type=int, default=None, help=f"default: ${names.ENV_STAGE}")
    add_device_argument(parser, auto=True)
    add_batch_arguments(parser)
    add_cache_arguments(parser)
    add_speculative_arguments(parser, pod=True)
    add_decode_argument(parser)
    add_waiting_argument(parser)
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                        help="weights as for serve; default: the plan's quantization (what the planner "
                             "sized the pods for, spec.serving.quantization)")
    parser.add_argument("--offload-budget", default=None, metavar="SIZE",
                        help="weights kept on the GPU, the rest streamed (as for serve); default: the "
                             "plan's offload_budget (spec.serving.offload)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="accepted API keys, one per line, as for serve: /v1/* then needs "
                             "'Authorization: Bearer <key>' (serving; /healthz and /metrics stay open)")


def _say(msg: str) -> None:
    print(f"shardwise worker: {msg}", file=sys.stderr, flush=True)


def _env_int(name: str, flag):
    if flag is not None:
        return flag
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        from shardwise.worker.errors import WorkerError
        raise WorkerError(f"${name}={value!r} is not an integer") from None


def read_contract(path: str):
    """The pod contract, validated (no torch needed); a WorkerError of one line when it is missing
    or invalid."""
    from shardwise.crds.contract import ContractError, load_contract

    from shardwise.worker.errors import WorkerError
    try:
        return load_contract(path)
    except ContractError as e:
        raise WorkerError(str(e)) from None


def _input_errors() -> tuple[type[Exception], ...]:
    """What bad input raises (a missing or empty dataset, a checkpoint of another model...): one line."""
    from shardwise.worker.training.checkpoint import CheckpointError
    from shardwise.worker.training.data import DataError
    from shardwise.worker.errors import WorkerError
    return WorkerError, DataError, CheckpointError


def run(args) -> int:
    try:
        return _run(args)
    except _input_errors() as e:
        _say(f"error: {e}")
        return Exit.BAD_INPUT


def _run(args) -> int:
    import torch

    from shardwise.crds.layout import RankLayout

    from shardwise.worker.errors import WorkerError
    from shardwise.worker.cli.flags import serving_settings
    from shardwise.worker.weights.offload import parse_bytes
    from shardwise.worker.serving.rank import RankSpec, validate

    contract = read_contract(args.contract)
    plan = contract.plan
    replica, stage, placement = _which_pod(args, plan)
    for var in (names.ENV_MASTER_ADDR, names.ENV_MASTER_PORT):
        if not os.environ.get(var):
            raise WorkerError(f"${var} is not set (the address of the replica's stage-0 pod)")
    host = args.host or names.bind_address(os.environ.get(names.ENV_POD_IP, ""))
    model_path, download = contract.model.path, None
    if contract.source is not None:    # a remote model: this stage's files into the cache first
        from shardwise.worker.cli.pod_fetch import fetch_model
        model_path, download = fetch_model(contract, placement, host)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = RankSpec(model=model_path, tensor=plan.tensor, pipeline=plan.pipeline,
                    layers=[(p.layer_start, p.layer_end) for p in plan.stages_of(replica)],
                    device=device, dtype=contract.model.dtype,   # validate() resolves auto
                    quantize=args.quantize or plan.quantization,
                    offload_budget=plan.offload_budget if args.offload_budget is None else parse_bytes(args.offload_budget),
                    **serving_settings(args, contract_settings(contract.serving), contract.serving.speculative))
    source = validate(spec, stages=[stage])     # the weights of this pod's stage, none other's
    if source.config.num_layers != plan.num_layers:
        raise WorkerError(f"plan splits {plan.num_layers} layers but model {contract.model.path} has "
                          f"{source.config.num_layers}")
    master = os.environ[names.ENV_MASTER_ADDR]
    if master.startswith("127.") or master == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if contract.workload == Workload.TRAINING:
        return _run_training(contract, replica, stage, device, spec.dtype, host, download)
    layout = RankLayout(plan.tensor, plan.pipeline)   # an inference replica is its own world
    world, ranks = layout.world_size, layout.stage_ranks(stage)
    _say(f"replica {replica} stage {stage}: layers [{placement.layer_start}, {placement.layer_end}), "
         f"ranks {ranks[0]}..{ranks[-1]} of {world}, {device} {spec.dtype}")
    api = _api_options(args, contract, spec, download)
    start, loaded_q = _rank_starter(plan.tensor, _rank_main, lambda local, q: (
        spec, ranks[local], world, local, host, api, q, dict(os.environ)))
    health = None
    if stage != 0:
        health = StageHealth(plan.tensor, host, contract.serving.port, download=download)
    # graceful: SIGTERM goes on to the ranks; rank 0 drains its requests (server.run_engine) and
    # then stops the pipeline, whose other ranks exit when the stop reaches them. The pod waits
    # for them all (its grace period bounds the wait).
    return _supervise(start, loaded_q, health,
                      stopping="stopping: rank 0 finishes its requests, then stops the pipeline")


def _which_pod(args, plan):
    """(replica, stage, placement) of this pod, from the flags or the environment."""
    from shardwise.worker.errors import WorkerError
    replica = _env_int(names.ENV_REPLICA, args.replica)
    stage = _env_int(names.ENV_STAGE, args.stage)
    if replica is None or stage is None:
        raise WorkerError(f"which stage is this pod? set ${names.ENV_REPLICA} and ${names.ENV_STAGE} "
                          "(or --replica/--stage)")
    try:
        return replica, stage, plan.placement(replica, stage)
    except KeyError:
        raise WorkerError(f"plan has no replica {replica} stage {stage}") from None


def contract_settings(serving) -> dict:
    """The RankSpec fields of a contract's serving settings (crds/capacity.py, resolved by the
    contract): what the planner sized the pod for, which the pod's flags may override."""
    return {"max_batch": serving.max_concurrent_requests, "max_seq": serving.max_model_length or 0,
            "kv_tokens": serving.kv_cache_tokens, "kv_block": serving.kv_block_size,
            "prefill_chunk": serving.prefill_chunk, "decode": serving.decode.value}


@dataclass(frozen=True)
class ApiOptions:
    """What rank 0 of stage 0 serves the API with: the contract's port, the model's name, the
    waiting queue's bound, the API keys' file (None: the API is open), and a remote model's final
    download report (answered at DOWNLOAD_PROGRESS_PATH; None: 404 there)."""
    port: int
    model_name: str
    max_waiting: int
    api_key_file: str | None = None
    download: bytes | None = None


def _api_options(args, contract, spec, download: bytes | None = None) -> ApiOptions:
    """The API's options from the contract and the flags, the API key file checked; says what the
    pod serves with."""
    _check_api_key_file(args.api_key_file)
    waiting = args.max_waiting or contract.serving.max_waiting
    cache = f"{spec.kv_tokens} tokens" if spec.kv_tokens else "a whole context per sequence"
    _say(f"serving {spec.max_batch} sequences at once, {waiting} waiting at most; KV cache {cache} in blocks "
         f"of {spec.kv_block}; decode {spec.decode}")
    return ApiOptions(contract.serving.port, contract.serving.model_name, waiting, args.api_key_file, download)


def _check_api_key_file(path: str | None) -> None:
    """Read once in the pod, so that a bad key file fails it before any rank starts; rank 0 reads
    it again for its server."""
    if path:
        from shardwise.worker.serving.http.auth import ApiKeys
        ApiKeys.from_file(path)


def _rank_starter(count: int, target, args_of):
    """What starts one process per local rank (from the fork server), each given
    `args_of(local_rank, queue)`, the queue being where ranks report that they have loaded.
    Returns (start, queue)."""
    from shardwise.worker.distributed.launch import forkserver
    mp = forkserver()
    queue = mp.Queue()

    def start() -> list:
        procs = [mp.Process(target=target, args=args_of(local, queue), daemon=False) for local in range(count)]
        for p in procs:
            p.start()
        return procs
    return start, queue


# How a pod watches its ranks: SIGTERM goes on to them, whatever signal the pod got; they stop by
# themselves (training: at an agreed step after a checkpoint; serving: rank 0 drains its requests,
# then stops the pipeline), and once they are stopping the pod waits for all of them, a failed
# one too (the pod's grace period bounds the wait). A rank that exits with a stop status (130/143)
# is waited out the same way. What still runs at the end is asked to stop, rank 0 first.
POD_GROUP = Policy(forward=signal.SIGTERM, wait_out_failures=True, poll_s=0.2, leftovers_grace_s=10)


def _supervise(start, loaded_q, health, stopped_code: int = Exit.OK,
               stopping: str = "stopping: the ranks finish their step and save a checkpoint") -> int:
    """Start the ranks and wait for them; report their loading; stop them all when one fails or on
    SIGTERM. 0 when every rank exited 0, 1 when one failed, `stopped_code` when a signal stopped them."""
    def report_loaded() -> None:
        while not loaded_q.empty():
            stats = loaded_q.get()
            _say(f"rank {stats['rank']} loaded {stats['weight_bytes']} weight bytes in {stats['load_seconds']:.1f}s")
            if health is not None:
                health.loaded(stats)

    outcome = supervise(start, POD_GROUP, on_poll=report_loaded, on_forward=lambda sig: _say(stopping))
    if health is not None:
        health.close()
    if outcome.ending is Ending.STOPPED:      # a signal stopped the pod before its ranks were all done
        return stopped_code
    if outcome.ending is Ending.FAILED:
        _say(f"a rank exited with code {outcome.failed[0][1]}; stopping the pod")
        return Exit.FAILED
    return Exit.OK


def _run_training(contract, replica: int, stage: int, device: str, dtype: str, host: str,
                  download: bytes | None = None) -> int:
    from shardwise.worker.cli.train import check_inputs
    from shardwise.worker.training.trainer import options_from_contract, pod_rank
    plan = contract.plan
    opts = options_from_contract(contract, device=device, dtype=dtype)
    # the data, the layout, the checkpoints' model, the local tier: one line before any rank starts
    check_inputs(opts, local_dir_name="checkpoint.local.path")
    first = pod_rank(replica, stage, 0, plan)
    _say(f"training replica {replica} stage {stage}: ranks {first}..{first + plan.tensor - 1} of "
         f"{opts.world_size}, {device} {dtype}, {opts.steps} steps, checkpoints in {opts.checkpoint_dir}")
    start, started_q = _rank_starter(plan.tensor, _train_rank_main, lambda local, q: (
        opts, plan, replica, stage, local, dict(os.environ), q))
    health = StageHealth(plan.tensor, host, contract.serving.port, progress_dir=opts.checkpoint_dir,
                         download=download)
    # Stopped by a signal before the last step, the pod must not look finished (exit 0 = Succeeded).
    code = _supervise(start, started_q, health, stopped_code=Exit.TERMINATED)
    if code == Exit.OK:
        _write_result(opts.checkpoint_dir, contract.termination_log)
    return code


def _write_result(checkpoint_dir: str, path: str) -> None:
    """The finished job's progress (steps, loss, last checkpoint) as the pod's termination message,
    where the operator reads it once the pod has Succeeded."""
    from shardwise.worker.training.trainer import read_progress
    progress = read_progress(checkpoint_dir)
    if progress is None:
        return
    try:
        with open(path, "w") as f:
            f.write(json.dumps(progress))
    except OSError as e:   # no termination log here: the result is in progress.json all the same
        _say(f"cannot write the termination message to {path}: {e}")


def _train_rank_main(opts, plan, replica, stage, local_rank, env, started_q) -> None:
    os.environ.update({k: v for k, v in env.items() if k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")})
    from shardwise.worker.training.trainer import run_training_rank

    def started(trainer) -> None:
        started_q.put({"rank": trainer.rank, "stage": trainer.pos.stage, "tp_rank": trainer.pos.tp_rank,
                       "weight_bytes": sum(p.numel() * p.element_size() for p in trainer.params),
                       "load_seconds": time.monotonic() - began, "step": trainer.step})
    began = time.monotonic()
    try:
        raise SystemExit(run_training_rank(opts, plan, replica, stage, local_rank, on_started=started))
    except _input_errors() as e:
        print(f"shardwise worker: rank {os.environ.get('RANK', local_rank)}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(Exit.BAD_INPUT)


def _rank_main(spec, rank, world, local_rank, host, api: ApiOptions, loaded_q, env) -> None:
    os.environ.update({k: v for k, v in env.items() if k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)})
    from shardwise.worker.errors import WorkerError
    from shardwise.worker.serving.rank import finish_rank, run_rank, setup_rank
    try:
        if rank != 0:
            # A serving rank other than 0 stops when rank 0 stops the pipeline, after draining its
            # requests; a SIGTERM of its own (the pod deleted) would cut those requests off.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            run_rank(spec, rank, world, local_rank, "env://", spec.tensor,
                     on_loaded=lambda ctx: loaded_q.put(ctx.loaded[rank]))
            return
        from shardwise.worker.weights.loader import open_model
        from shardwise.worker.serving.http.auth import ApiKeys
        from shardwise.worker.serving.http.server import App, Server, run_engine, workers_for
        from shardwise.worker.weights.tokenizer import load_tokenizer
        # The API reports the ShardedModel's name (the contract's serving.model_name).
        keys = ApiKeys.from_file(api.api_key_file) if api.api_key_file else None
        app = App(api.model_name, load_tokenizer(open_model(spec.model)), api_keys=keys, max_waiting=api.max_waiting)
        app.download = api.download
        server = Server(app, host, api.port, workers=workers_for(spec.max_batch + api.max_waiting)).start()
        stop = stop_on_signals()
        ctx = setup_rank(spec, 0, world, local_rank, "env://", spec.tensor)
        loaded_q.put(ctx.loaded[0])
        try:
            run_engine(app, ctx, stop)
        finally:
            ctx.stage.stop()
            finish_rank(ctx)
            server.close()
    except WorkerError as e:
        print(f"shardwise worker: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(Exit.BAD_INPUT)
    except OSError as e:
        print(f"shardwise worker: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(Exit.FAILED)
