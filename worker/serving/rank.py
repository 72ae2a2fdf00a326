"""Process launch and per-rank setup.

Two ways in, one setup (`setup_rank`):
  * `LocalRuntime(spec)`: `shardwise generate/serve` on one machine. The calling process is
    rank 0 (the driver); the other TP x PP - 1 ranks are started from a fork server that has torch
    and this package imported already, so a rank starts in a fraction of a second.
  * `run_rank(spec, rank, world, local_rank)`: one rank under the torchrun variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which is how a ShardedModel pod runs
    (cmd_worker.py).
Backends: gloo on CPU (on loopback for local runs), NCCL on CUDA. On CPU a TP group's small
all-reduces go through shared memory instead when its ranks can share a file (shm_allreduce.py).
"""
from __future__ import annotations

import datetime
import os
import resource
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.crds.layout import RankLayout, split_layers
from shardwise.crds.modelshape import BLOCK_ACTIVATIONS, BlockActivations, in_memory_dtype

from shardwise.worker.distributed import tensor_parallel as parallel
from shardwise.worker.distributed.launch import forkserver
from shardwise.worker.distributed.placement import place_in_huge_pages
from shardwise.worker.errors import WorkerError
from shardwise.worker.model.inference import install_fused_weights
from shardwise.worker.weights.loader import DTYPES, check_layout, check_stage, load_stage, open_model
from shardwise.worker.serving import defaults
from shardwise.worker.serving.pipeline import OP_SETUP, OP_STEP, Stage, StageInfo, decode_mode
from shardwise.worker.weights.offload import apply_offload
from shardwise.worker.weights.quantize import check_method, quantize_weights

PG_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SHARDWISE_PG_TIMEOUT", "600")))


@dataclass
class RankSpec:
    """Everything a rank needs besides its rank number; picklable, so it crosses to children."""
    model: str
    tensor: int = 1
    pipeline: int = 1
    layers: list[tuple[int, int]] = field(default_factory=list)   # per stage; empty: the planner's split
    device: str = "cpu"
    dtype: str = "auto"           # validate() resolves auto (crds/modelshape.py in_memory_dtype)
    max_batch: int = defaults.MAX_BATCH
    max_seq: int = 0              # 0: min(model context, defaults.DEFAULT_CONTEXT)
    threads: int = 0              # torch intra-op threads per rank; 0: cores / local ranks
    decode: str = "auto"          # pipeline.py decode_mode: auto, eager, graphs, compile
    quantize: str = "none"        # quantize.py: none, int8 (weight-only, decoder layers), gguf (the file's blocks)
    block_activations: str = BLOCK_ACTIVATIONS.value   # gguf on a CPU: weights/block_dot.py
    offload_budget: int = 0       # offload.py: bytes of weights kept on the device, the other layers streamed; 0: all
    # The KV cache (scheduler.py, kv_blocks.py): its size in tokens (0: max_batch whole contexts),
    # tokens per block, prompt tokens of one request per step, and tokens per step in all.
    kv_tokens: int = 0
    kv_block: int = defaults.KV_BLOCK_SIZE
    prefill_chunk: int = defaults.PREFILL_CHUNK
    max_step_tokens: int = defaults.MAX_STEP_TOKENS      # tokens per step (scheduler.py)
    speculative: object = None    # speculative.SpeculativeConfig: prompt-lookup drafts; None: none


@dataclass
class RankContext:
    spec: RankSpec
    info: StageInfo
    stage: Stage
    config: object
    max_seq: int
    loaded: list[dict] = field(default_factory=list)   # per rank: weight bytes, load seconds, ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _device_for(spec: RankSpec, local_rank: int) -> str:
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise WorkerError("--device cuda: no CUDA device is available")
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return "cpu"


def setup_rank(spec: RankSpec, rank: int, world: int, local_rank: int, init_method: str = "env://",
               local_ranks: int = 1) -> RankContext:
    """Join the process group, load this rank's slice of its stage, and wait for every rank."""
    device = _device_for(spec, local_rank)
    if device == "cpu":
        torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    else:
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    parallel.COMM.__init__()
    t, p = spec.tensor, spec.pipeline
    layout = RankLayout(t, p)   # an inference replica is a world of its own
    _, stage_idx, tp_rank = layout.position(rank)
    groups = [dist.new_group(layout.stage_ranks(s)) if t > 1 else None for s in range(p)]
    info = StageInfo(rank, world, t, p, stage_idx, tp_rank, groups[stage_idx])
    parallel.use_shm_allreduce(info.tp_group, PG_TIMEOUT.total_seconds())   # the TP ranks share a host
    t0 = time.perf_counter()
    source = open_model(spec.model)
    layers = spec.layers or split_layers(source.config.facts(), p).ranges
    start, end = layers[stage_idx]
    # Streaming layers: the stage is loaded, fused and quantized in host memory, then what fits
    # the budget moves to the device (offload.py).
    model = load_stage(source, start, end, embedding=stage_idx == 0, head=stage_idx == p - 1,
                       tp_rank=tp_rank, tp_world=t, group=info.tp_group,
                       device="cpu" if spec.offload_budget else device, dtype=DTYPES[spec.dtype],
                       keep_blocks=spec.quantize == "gguf")
    install_fused_weights(model)
    if spec.quantize == "none":
        place_in_huge_pages(model)                         # quantize_weights places what it builds
    quantize_weights(model, spec.quantize, device,         # this rank's slices only
                     BlockActivations(spec.block_activations))
    if spec.offload_budget:
        apply_offload(model, spec.offload_budget, device)
    stats = {"rank": rank, "stage": stage_idx, "tp_rank": tp_rank, "layers": [start, end],
             "weight_bytes": parallel.weight_bytes(model), "load_seconds": time.perf_counter() - t0,
             "peak_rss_bytes": peak_rss_bytes()}
    loaded: list = [None] * world
    dist.all_gather_object(loaded, stats)        # doubles as the "every rank has loaded" barrier
    return RankContext(spec, info, Stage(model, info, device, spec.decode), source.config,
                       context_length(spec, source.config), loaded)


def teacher_forced_nll(ctx: RankContext, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given what precedes each (its exp is the
    perplexity), through the real stages: each token fed as a decode step of one request, the
    last stage's logits of that step scored. Rank 0 of a local runtime calls it; the quantized
    formats' quality bound is measured with it (tests, benchmarks/quant_bench.py)."""
    stage, slot = ctx.stage, torch.tensor([0])
    stage.launch(OP_SETUP, cache_blocks=1, seq=ctx.max_seq)
    rows = []
    for pos, tok in enumerate(ids[:-1]):
        stage.launch(OP_STEP, torch.tensor([[tok]]), torch.tensor([[pos]]), slot)
        rows.append(stage.collect()[0].float().cpu())
    return float(torch.nn.functional.cross_entropy(torch.stack(rows), torch.tensor(ids[1:])))


def context_length(spec: RankSpec, config) -> int:
    """Tokens per request the KV cache holds: --max-seq-len, capped by the model's context."""
    ctx_len = config.max_position_embeddings
    return min(spec.max_seq or min(ctx_len, defaults.DEFAULT_CONTEXT), ctx_len)


def finish_rank(ctx: RankContext) -> list[dict] | None:
    """Collect each rank's final figures on rank 0, then leave the process group."""
    final = {"rank": ctx.info.rank, "comm_seconds": parallel.COMM.seconds, "comm_bytes": parallel.COMM.bytes,
             "peak_rss_bytes": peak_rss_bytes()}
    if ctx.spec.device == "cuda":
        final["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    out = [None] * ctx.info.world if ctx.info.rank == 0 else None
    dist.gather_object(final, out, dst=0)
    parallel.close_shm_allreduces()
    dist.destroy_process_group()
    return out


def run_rank(spec: RankSpec, rank: int, world: int, local_rank: int, init_method: str = "env://",
             local_ranks: int = 1, on_loaded=None) -> None:
    """A rank other than 0: load, then follow rank 0's steps until it stops the pipeline."""
    ctx = setup_rank(spec, rank, world, local_rank, init_method, local_ranks)
    if on_loaded is not None:
        on_loaded(ctx)
    ctx.stage.serve_forever()
    finish_rank(ctx)


def _child(spec: RankSpec, rank: int, world: int, init_method: str, errors) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        run_rank(spec, rank, world, rank, init_method, local_ranks=world)
    except WorkerError as e:
        errors.put(f"rank {rank}: {e}")
        raise SystemExit(1)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which prints one line
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        if os.environ.get("SHARDWISE_DEBUG"):
            traceback.print_exc()
        raise SystemExit(1)


def validate(spec: RankSpec, stages: list[int] | None = None):
    """Checks done once before any process starts: model readable, layout fits the model, the
    weights of the stages this process loads (`stages`; None: all, a local run) at hand. Resolves
    spec.dtype "auto" here, before the spec is handed to the ranks, so that they all load alike."""
    source = open_model(spec.model)
    check_layout(source.config, spec.tensor, spec.pipeline)
    if spec.layers:
        if len(spec.layers) != spec.pipeline or spec.layers[-1][1] != source.config.num_layers:
            raise WorkerError(f"layer ranges {spec.layers} do not cover the model's "
                              f"{source.config.num_layers} layers in {spec.pipeline} stages")
    layers = spec.layers or split_layers(source.config.facts(), spec.pipeline).ranges
    for s in range(spec.pipeline) if stages is None else stages:
        check_stage(source, *layers[s], embedding=s == 0, head=s == spec.pipeline - 1)
    if spec.dtype != "auto" and spec.dtype not in DTYPES:
        raise WorkerError(f"unknown dtype {spec.dtype!r} (use one of: auto, {', '.join(DTYPES)})")
    spec.dtype = in_memory_dtype(spec.dtype, source.dtype, spec.device)
    decode_mode(spec.decode, spec.device, spec.tensor, spec.offload_budget > 0,   # one line now, not per rank
                source.config.num_experts > 0)
    check_method(spec.quantize)
    if spec.quantize != "none" and source.config.num_experts:
        raise WorkerError(f"--quantize {spec.quantize} does not cover mixture-of-experts layers yet; use none")
    if spec.quantize == "gguf":
        check_gguf_blocks(source, spec.dtype)
    return source


def check_gguf_blocks(source, dtype: str) -> None:
    """`--quantize gguf` needs a GGUF file; its layer matrices of a type with no fast path are
    dequantized, said in one line here (once, before any rank loads)."""
    from shardwise.worker.weights.gguf_blocks import NATIVE
    slow = getattr(source, "slow_matrices", None)
    if slow is None:
        raise WorkerError(f"--quantize gguf keeps a GGUF file's {', '.join(NATIVE)} blocks; "
                          f"{source.path} is not a GGUF file (--quantize int8 works for any model)")
    counts = slow()
    if counts:
        types = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        print(f"notice: {types} layer matrices have no fast path and are dequantized to {dtype} "
              f"(kept as stored: {', '.join(NATIVE)})", file=sys.stderr, flush=True)


class LocalRuntime:
    """TP x PP ranks on this machine; this process is rank 0 and drives them."""

    def __init__(self, spec: RankSpec, source=None):
        self.spec = spec
        self.world = RankLayout(spec.tensor, spec.pipeline).world_size
        if self.world > 1 and source is None:
            forkserver(start=True)      # the ranks' server imports torch while the model is checked
        self.source = source or validate(spec)
        self.procs: list = []
        self.ctx: RankContext | None = None
        self.final: list[dict] | None = None

    def start(self) -> RankContext:
        mp = forkserver()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.errors = mp.Queue()
        for rank in range(1, self.world):
            p = mp.Process(target=_child, args=(self.spec, rank, self.world, init_method, self.errors),
                           daemon=True)
            p.start()
            self.procs.append(p)
        try:
            self.ctx = setup_rank(self.spec, 0, self.world, 0, init_method, local_ranks=self.world)
        except Exception as e:
            self._kill()
            msg = self._child_error()
            if msg:
                raise WorkerError(msg) from None
            raise e
        return self.ctx

    def _child_error(self) -> str | None:
        try:
            return self.errors.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty: no child reported anything
            return None

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
        if dist.is_initialized():
            parallel.close_shm_allreduces()
            dist.destroy_process_group()

    def stop(self) -> list[dict] | None:
        if self.ctx is None:
            return None
        try:
            self.ctx.stage.stop()
            self.final = finish_rank(self.ctx)
        finally:
            self.ctx = None
            for p in self.procs:
                p.join(30)
            self._kill()
        return self.final

    def __enter__(self) -> RankContext:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def generate_local(spec: RankSpec, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: list[int] = ()) -> tuple[list[list[int]], list[dict]]:
    """Greedy-generate for token-id prompts (batched together) on a fresh local launch.
    Returns the generated ids per prompt and each rank's load figures."""
    from shardwise.worker.serving.engine import Engine
    from shardwise.worker.serving.request import Request
    with LocalRuntime(spec) as ctx:
        engine = Engine.for_rank(ctx, list(eos_ids))
        reqs = engine.generate([Request(list(p), max_new_tokens=max_new_tokens) for p in prompts])
        return [r.token_ids for r in reqs], ctx.loaded
