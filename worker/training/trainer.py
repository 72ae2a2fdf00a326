"""Causal-LM training of the unchanged model on PyTorch's parallel stack.

One process per rank; a DeviceMesh dp_replicate × dp_shard × pp × tp whose rank order is
crds/layout.py RankLayout's (parallelize.py). Each step:

  1. the global batch of the step (data.py: a function of seed and step only) is split across the
     D = replicate × shard data-parallel replicas, and each sequence over the C context-parallel
     ranks of a replica (context_parallel.py);
  2. with one stage, forward and backward over the replica's share; with P stages, a
     torch.distributed.pipelining schedule (schedules.py: GPipe, 1F1B or interleaved 1F1B) over
     micro-batches of it;
  3. tensor parallel is DTensor's, FSDP2 shards parameters, gradients and AdamW state over
     dp_shard and averages gradients over the data-parallel axes (reduced in fp32 against fp32
     master weights; compute in the compute dtype); with gradient compression on, the replicate
     axis is averaged by compression.py instead, with error feedback;
  4. a tied embedding/head pair split across first and last stage has its two gradients summed,
     the global gradient norm is clipped (every element counted once), and AdamW steps;
  5. every K steps the state is checkpointed asynchronously (checkpoint_tiers.py) in full-tensor
     coordinates (each DTensor shard by its offsets), so any later layout can resume it; in
     between, optionally every L steps, each rank saves its own state to node-local storage (the
     local tier: no collective, readable only by the same rank of the same layout);
  6. the ranks agree every step (one all-reduce MAX of a stop flag) whether a signal asked them to
     stop: on SIGTERM/SIGINT every rank finishes the step, they save a shared checkpoint
     synchronously at the same step and exit 128 + the signal.

Loss = mean token cross-entropy over the whole global batch, identical in every layout up to
floating-point summation order.

Here: the Trainer (one rank's state and step) and the run loop (run_training). What a run is asked
to do is options.py, the stages and their state as slices model_state.py, what it reports
progress.py; their names a rank's entry points use (TrainOptions, options_from_contract, pod_rank,
read_progress) are importable from here too.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardwise.crds.layout import split_layers
from shardwise.crds.modelshape import in_memory_dtype

from shardwise.worker.errors import WorkerError
from shardwise.worker.training import checkpoint as ckpt
from shardwise.worker.training import checkpoint_tiers as tiers
from shardwise.worker.training import compression_state as cstate
from shardwise.worker.training import context_parallel as cp
from shardwise.worker.training import parallelize as par
from shardwise.worker.training import schedules as pipe
from shardwise.worker.training.compression import GradientCompressor, plain_all_reduce_mean_
from shardwise.worker.training.frozen_adam import frozen_variance_step_
from shardwise.worker.training.data import StepBatches, TokenDataset
from shardwise.worker.training.model_state import build_stage, init_optimizer_state, model_files, optimizer_slices, param_slices
from shardwise.worker.training.options import (TrainOptions, layout_record, options_from_contract, pod_rank,  # noqa: F401
                                              precision_problem, shared_store)
from shardwise.worker.training.progress import announce, emitter, read_progress, write_progress  # noqa: F401
from shardwise.worker.weights.loader import DTYPES, check_layout, open_model
from shardwise.worker.weights.tokenizer import load_tokenizer

# FSDP2 warns when a stage returns a view (the TP-gathered logits): in-place ops on it would skip
# its hooks, and none is ever done here (the loss only reads the logits).
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

# A rank that waits longer than this for its peers in a collective fails instead of hanging.
_PG_TIMEOUT = datetime.timedelta(minutes=10)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- one training step

class Trainer:
    def __init__(self, opts: TrainOptions, rank: int, emit: Callable[[dict], None] | None = None):
        self.opts, self.rank = opts, rank
        self.layout = opts.layout
        self.pos = self.layout.position(rank)
        self.device = torch.device(opts.device if opts.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.emit = emit or (lambda rec: None)
        source = self.source = open_model(opts.model)
        self.config = source.config
        if self.config.num_experts:
            raise WorkerError(f"{opts.model}: training mixture-of-experts models is not supported yet "
                              f"(serving them is: shardwise generate / serve)")
        check_layout(self.config, opts.tensor, opts.pipeline)
        problem = opts.problem(self.config.num_layers) or precision_problem(opts, self.config)
        if problem:
            raise WorkerError(problem)
        # "auto" (the ShardedModel default): the rule the planner sized the job by
        self.compute_dtype = DTYPES[in_memory_dtype(opts.dtype, source.dtype, self.device.type)]
        self.mesh = opts.mesh_shape.build(self.device.type)
        self._build_stages()
        self.params = list(dict.fromkeys(p for m in self.modules for p in m.parameters()))   # a tied pair once
        self.optimizer = torch.optim.AdamW(self.params, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=opts.weight_decay, foreach=False)
        init_optimizer_state(self.params, self.optimizer)
        self._setup_groups()
        self.compressor = None
        if opts.compression != "none" and opts.mesh_shape.replicate > 1:
            self.compressor = GradientCompressor(opts.compression, self.mesh.get_group("dp_replicate"),
                                                 density=opts.compression_density, rank=opts.compression_rank)

        tokenizer = load_tokenizer(source)
        self.data = TokenDataset.from_file(opts.data, tokenizer.encode)
        self.batches = StepBatches(self.data, opts.seq_len, opts.batch_size, opts.seed)
        self.manager = tiers.CheckpointManager(
            shared_store(opts), rank=rank, group=self.checkpoint_group,
            model_meta=ckpt.structure_of(self.config.to_dict()), keep=opts.keep,
            asynchronous=opts.async_checkpoint, log=lambda m: self.emit({"event": "log", "message": m}),
            files=model_files(source, tokenizer))
        self.local = None
        if opts.local_checkpoint_dir and opts.local_every > 0:
            try:
                self.local = tiers.LocalCheckpointManager(
                    opts.local_checkpoint_dir, rank=rank, fingerprint=self.local_fingerprint(),
                    keep=opts.local_keep, asynchronous=opts.async_checkpoint)
            except OSError as e:
                raise WorkerError(f"local checkpoint directory {opts.local_checkpoint_dir} is not writable: "
                                  f"{e.strerror or e}") from None
        self.resumed_from: dict | None = None   # {"tier": "local"|"shared", "step": N}
        self.step = 0
        self.replicate_bytes = 0      # sent by this rank on the replicate axis since it started

    def _build_stages(self) -> None:
        opts, P = self.opts, self.opts.pipeline
        schedule = opts.schedule if P > 1 else "1F1B"
        n = P * pipe.virtual_stages(schedule)
        self.indices = pipe.stage_indices(self.pos.stage, P, schedule)
        use_plan = opts.stage_layers is not None and len(opts.stage_layers) == n
        ranges = opts.stage_layers if use_plan else split_layers(self.config.facts(), n).ranges
        self.holds_first, self.holds_last = 0 in self.indices, n - 1 in self.indices
        self.stage_ranges = [list(ranges[i]) for i in self.indices]
        self.modules = [build_stage(self.source, *ranges[i], i == 0, i == n - 1, self.mesh, opts,
                                    self.device, self.compute_dtype) for i in self.indices]
        self.schedule = None
        if P > 1:
            self.schedule = pipe.build_schedule(self.modules, self.indices, P, schedule,
                                                opts.micro_batches_per_replica(), self.device,
                                                self.mesh.get_group("pp"), _loss)

    def _setup_groups(self) -> None:
        """Groups beyond the mesh's; every rank creates all of them in the same order."""
        layout, R = self.layout, self.layout.rank
        self.tie_group = None
        if self.opts.pipeline > 1:   # first and last stage hold the two copies of a tied embedding/head
            for r in range(layout.replicas):
                for t in range(layout.tensor):
                    g = dist.new_group([R(r, 0, t), R(r, layout.pipeline - 1, t)], backend="gloo"
                                       if self.device.type == "cpu" else None)
                    if (r, t) == (self.pos.replica, self.pos.tp_rank):
                        self.tie_group = g
        # Checkpoint writes run in a background thread: their own gloo group keeps their
        # collectives from ever interleaving with the training collectives.
        self.checkpoint_group = dist.new_group(list(range(layout.world_size)), backend="gloo")
        # The per-step stop agreement runs in the training thread while a shared save may be using
        # the checkpoint group in the background: a group of its own keeps the two apart.
        self.control_group = dist.new_group(list(range(layout.world_size)), backend="gloo")
        tied = self.config.tie_word_embeddings and self.opts.pipeline > 1
        holders = layout.world_size // layout.pipeline
        self.norm_params = [(p, holders) for m in self.modules for name, p in m.named_parameters()
                            if not (tied and name == "output.weight")]   # the tied copy counted once

    # -- state
    def state_slices(self, residuals: bool = True) -> dict[str, ckpt.Slice]:
        out = {}
        for m in self.modules:
            out.update(param_slices(m))
            out.update(optimizer_slices(m, self.optimizer))
        if residuals and self.compressor is not None:
            out.update(self.residual_slices())
            out.update(self.basis_slices())
        return out

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for m in self.modules for name, p in m.named_parameters()}

    def residual_slices(self) -> dict[str, ckpt.Slice]:
        return cstate.residual_slices(self.compressor, self.params, self._param_names(),
                                      self.mesh["dp_replicate"].get_local_rank())

    def basis_slices(self) -> dict[str, ckpt.Slice]:
        return cstate.basis_slices(self.compressor, self.params, self._param_names())

    def local_fingerprint(self) -> dict:
        """What a local checkpoint must have been saved by to be loaded by this rank: the same
        layout (and layer split), the same global rank in a world of the same size, the same model."""
        return {"layout": layout_record(self.opts), "stages": self.stage_ranges, "rank": self.rank,
                "world_size": self.layout.world_size, "model": ckpt.structure_of(self.config.to_dict())}

    def resume(self) -> dict | None:
        """Load the newest state: the local tier's when every rank has a matching local checkpoint
        newer than the newest complete shared one, else the shared tier's (resharded if need be)."""
        slices = self.state_slices()
        shared = self.manager.newest()
        meta = self._resume_local(slices, shared) if self.local is not None else None
        if meta is not None:
            if shared is not None:   # progress.json's last_checkpoint stays the shared tier's
                self.manager.last_committed = (shared[0], shared[1].get("time", 0.0))
            return self._resumed(meta, "local")
        meta = self.manager.load_latest(self.state_slices(residuals=False), agree=self._agree)
        if meta is None:
            return None
        if self.compressor is not None:
            how = cstate.load_residuals(self.manager.store, int(meta["step"]), self.residual_slices(), self.mesh["dp_replicate"].get_local_rank(),
                                        self.opts.mesh_shape.replicate)
            self.emit({"event": "log", "message": how})
            how = cstate.load_bases(self.manager.store, int(meta["step"]), self.basis_slices())
            if how:
                self.emit({"event": "log", "message": how})
        return self._resumed(meta, "shared")

    def _resume_local(self, slices: dict[str, ckpt.Slice], shared: tuple[int, dict] | None) -> dict | None:
        """Every rank lists its matching local steps; they take the newest step all of them have,
        if it is newer than the shared tier's (rank 0's view of it), and load it or all fall back."""
        mine = self.local.matching_steps()
        everyone: list = [None] * self.layout.world_size
        dist.all_gather_object(everyone, (mine, None if shared is None else shared[0]), group=self.checkpoint_group)
        common = set(everyone[0][0]).intersection(*(set(steps) for steps, _ in everyone[1:]))
        newest_shared = everyone[0][1]
        OK, SKIP = 1, 0
        for step in sorted(common, reverse=True):
            if newest_shared is not None and step <= newest_shared:
                break
            code, error, meta = OK, None, None
            try:
                meta = self.local.load(step, slices)
            except ckpt.CheckpointError as e:
                code, error = SKIP, e
            if self._agree(code) == OK:
                return meta
            warnings.warn(f"{error or f'local checkpoint step {step} is damaged on another rank'}; "
                          f"falling back to an older checkpoint", stacklevel=2)
        return None

    def _resumed(self, meta: dict, tier: str) -> dict:
        self.step = int(meta["step"])
        self.resumed_from = {"tier": tier, "step": self.step}
        if meta.get("rng"):
            torch.set_rng_state(ckpt.rng_from_text(meta["rng"]))
        pos = meta.get("data", {})
        if pos.get("fingerprint") not in (None, self.data.fingerprint):
            warnings.warn(f"checkpoint step {self.step} was trained on another dataset "
                          f"({pos.get('dataset')}); continuing on {self.opts.data}", stacklevel=2)
        return meta

    def _agree(self, code: int) -> int:
        """The smallest status code over all ranks (so every rank takes the same decision)."""
        t = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.checkpoint_group)
        return int(t.item())

    def save(self) -> None:
        extra = {"data": self.batches.position(self.step), "rng": ckpt.rng_to_text(torch.get_rng_state()),
                 "model_config": self.config.to_dict(), "layout": layout_record(self.opts)}
        self.manager.save(self.step, self.state_slices(), extra)

    def save_local(self) -> None:
        """This rank's state to the local tier (no collective)."""
        extra = {"data": self.batches.position(self.step), "rng": ckpt.rng_to_text(torch.get_rng_state()),
                 "layout": layout_record(self.opts)}
        self.local.save(self.step, self.state_slices(), extra)

    def agree_stop(self, signum: int) -> int:
        """The largest signal number any rank was asked to stop by (0: none): every rank gets
        the same answer after the same step, so they all stop together."""
        if self.layout.world_size == 1:
            return signum
        t = torch.tensor([signum], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group)
        return int(t.item())

    # -- the step
    def train_step(self) -> dict:
        step = self.step + 1
        opts = self.opts
        # RankLayout's replica is (data-parallel replica)·C + cp rank (parallelize.py's mesh order)
        replica, cp_rank = divmod(self.pos.replica, opts.context)
        batch = self.batches.batch(step, replica, opts.data_parallel).to(self.device)
        inputs = cp.local_part(batch[:, :-1], cp_rank, opts.context)
        targets = cp.local_part(batch[:, 1:], cp_rank, opts.context)
        self.optimizer.zero_grad(set_to_none=True)
        lr = opts.lr * min(1.0, step / opts.warmup) if opts.warmup else opts.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local_loss = self._forward_backward(inputs, targets)
        sent = self._sync_grads()
        self.replicate_bytes += sent
        norm = par.clip_grad_norm_(self.norm_params, opts.grad_clip, self.device)
        if self.compressing(step) and opts.compression_warmup:
            frozen_variance_step_(self.optimizer, opts.compression_warmup)
        else:
            self.optimizer.step()
        self.step = step
        # Mean loss over the global batch: the last stage's TP rank 0 of each replica (and of each
        # context-parallel rank of it: the same number of tokens each) contributes.
        report = local_loss if (self.holds_last and self.pos.tp_rank == 0) else torch.zeros_like(local_loss)
        dist.all_reduce(report)
        return {"step": step, "loss": report.item() / self.layout.replicas, "lr": lr, "grad_norm": norm,
                "replicate_bytes": sent}

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This replica's share through the stages; the mean loss on the last stage (else 0)."""
        if self.schedule is None:
            loss = _loss(self.modules[0](inputs), targets)
            loss.backward()
            return loss.detach().float()
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first else ()
        if self.holds_last:
            self.schedule.step(*args, target=targets, losses=losses)
            return torch.stack([x.detach().float() for x in losses]).mean()
        self.schedule.step(*args)
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def compressing(self, step: int) -> bool:
        """Whether step `step` averages the replicate axis compressed (after the dense warm-up)."""
        return self.compressor is not None and step > self.opts.compression_warmup

    def _sync_grads(self) -> int:
        """What FSDP does not: the replicate axis when compressed, the tied pair across stages.
        Returns the bytes this rank sent on the replicate axis this step."""
        if self.compressor is not None:   # one gradient per parameter: a residual's position is its parameter's
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sent = 0
        if self.compressor is not None and self.compressing(self.step + 1):
            before = self.compressor.bytes_sent
            self.compressor.all_reduce_mean_(local)
            sent = self.compressor.bytes_sent - before
        elif self.compressor is not None:   # the dense warm-up
            sent = plain_all_reduce_mean_(local, self.compressor.group)
        elif self.opts.mesh_shape.replicate > 1:   # HSDP's all-reduce of fp32 gradient shards
            sent = sum(t.numel() * 4 for t in local)
        if self.tie_group is not None and self.config.tie_word_embeddings:
            for m in self.modules:
                tied = m.tok_embeddings if m.tok_embeddings is not None else m.output
                if tied is not None and tied.weight.grad is not None:
                    g = tied.weight.grad
                    dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.tie_group)
        return sent


# ---------------------------------------------------------------- entry point for one rank

def run_training(opts: TrainOptions, rank: int | None = None, world_size: int | None = None,
                 out=sys.stdout, on_started: Callable[["Trainer"], None] | None = None) -> int:
    """Train as one rank of a world of T*P*D processes (torchrun variables if not given).

    This is what `shardwise train` runs in each local process and what a training pod's
    `shardwise worker` calls. Rank 0 prints progress (JSON lines with --json) and writes
    `<checkpoint_dir>/progress.json`. `on_started(trainer)` is called once this rank has joined
    the world and loaded its slice (resumed from a checkpoint, if there was one). Returns 0 when
    all steps are done and the last checkpoint is committed; 128 + the signal number when SIGTERM
    or SIGINT (to any rank) stopped the job before that, after a shared checkpoint of the step
    every rank stopped at is committed.
    """
    rank = _join_world(opts, rank, world_size)
    lead = rank == 0
    # Warnings (a damaged checkpoint skipped, another dataset) as one line each, from rank 0 only.
    warnings.showwarning = lambda message, *a, **k: (
        print(f"warning: {message}", file=sys.stderr, flush=True) if lead else None)
    emit = emitter(opts, lead, out)
    stop = _StopSignals()
    try:
        stop.install()
        trainer = Trainer(opts, rank, emit)
        announce(trainer, trainer.resume(), emit)
        if on_started is not None:
            on_started(trainer)
        if lead:
            Path(opts.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        last_loss = None
        while trainer.step < opts.steps:
            t0 = time.perf_counter()
            rec = trainer.train_step()
            last_loss = rec["loss"]
            # Every rank has finished the same step: stop here if a signal reached any of them.
            stopping = trainer.agree_stop(stop.signum) if trainer.step < opts.steps else 0
            _checkpoint_after_step(trainer, rec, stopping)
            rec["tokens_per_s"] = opts.batch_size * opts.seq_len / (time.perf_counter() - t0)
            emit(rec)
            if stopping:
                _stop_here(trainer, rec, emit)
                return 128 + stopping
            if lead:
                write_progress(opts, trainer, rec)
        _finish(trainer, last_loss, emit)
        return 0
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_world(opts: TrainOptions, rank: int | None, world_size: int | None) -> int:
    """This process's rank, once it has joined the job's process group."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size != opts.world_size:
        cp_text = f" x {opts.context} context parallel" if opts.context > 1 else ""
        raise WorkerError(f"{world_size} processes for a layout of {opts.tensor} tensor x {opts.pipeline} "
                          f"pipeline x {opts.data_parallel} data parallel{cp_text} = {opts.world_size} ranks")
    torch.manual_seed(opts.seed)
    if not dist.is_initialized():
        # CUDA: NCCL for tensors on the GPU, gloo for the CPU-side agreement and checkpoint groups
        backend = "cpu:gloo,cuda:nccl" if opts.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=_PG_TIMEOUT)
    return rank


def _checkpoint_after_step(trainer: Trainer, rec: dict, stopping: int) -> None:
    """The shared tier every checkpoint_every steps, at the last step and when stopping (then
    synchronously: the next attempt may be on other nodes); else the local tier every local_every."""
    opts = trainer.opts
    if (opts.checkpoint_every and trainer.step % opts.checkpoint_every == 0) or trainer.step == opts.steps \
            or stopping:
        t_save = time.perf_counter()
        trainer.save()
        if stopping:
            trainer.manager.wait()
        blocking = time.perf_counter() - t_save if stopping else trainer.manager.last_blocking_s
        rec.update(checkpoint=ckpt.step_dir_name(trainer.step), checkpoint_tier="shared",
                   checkpoint_blocking_s=round(blocking, 4))
    elif trainer.local is not None and trainer.step % opts.local_every == 0:
        trainer.save_local()
        rec.update(checkpoint=ckpt.step_dir_name(trainer.step), checkpoint_tier="local",
                   checkpoint_blocking_s=round(trainer.local.last_blocking_s, 4))


def _stop_here(trainer: Trainer, rec: dict, emit) -> None:
    """Every rank stops at this step, once its checkpoint is committed."""
    if trainer.local is not None:
        trainer.local.wait()
    dist.barrier(group=trainer.control_group)    # rank 0 has committed the checkpoint
    if trainer.rank == 0:
        write_progress(trainer.opts, trainer, rec)
    emit({"event": "log", "step": trainer.step,
          "message": f"stopping at step {trainer.step}: checkpoint {ckpt.step_dir_name(trainer.step)} saved"})


def _finish(trainer: Trainer, last_loss: float | None, emit) -> None:
    """All steps done: wait for the last checkpoints, report, and leave together."""
    opts = trainer.opts
    trainer.manager.wait()
    if trainer.local is not None:
        trainer.local.wait()
    if trainer.rank == 0:
        write_progress(opts, trainer, {"step": trainer.step, "done": True, "loss": last_loss})
    emit({"event": "done", "step": trainer.step,
          "message": f"done: {trainer.step} steps, last checkpoint "
                     f"{ckpt.step_dir_name(trainer.step)} in {trainer.manager.store}"})
    dist.barrier()


class _StopSignals:
    """SIGTERM and SIGINT only ask the training loop to stop after the current step (`signum`
    becomes the signal's number); the previous handlers come back at the end. Handlers can only
    be set from the main thread: elsewhere (a test calling run_training in a thread) nothing
    changes."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self.previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or int(signum)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


def run_training_rank(opts: TrainOptions, plan, replica: int, stage: int, local_rank: int,
                      on_started: Callable[["Trainer"], None] | None = None) -> int:
    """A training pod's rank process: `opts` from options_from_contract, global rank from
    (replica, stage, local GPU). MASTER_ADDR/MASTER_PORT must name replica 0, stage 0."""
    if opts.device == "cuda":
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    return run_training(opts, rank=pod_rank(replica, stage, local_rank, plan), world_size=opts.world_size,
                        on_started=on_started)

