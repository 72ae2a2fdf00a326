"""Causal-LM training of the unchanged model under tensor × pipeline × data parallelism.

One process per rank; global ranks by crds/layout.py RankLayout over all D replicas (the ShardPlan
layout within a replica, replicas stacked). Each step:

  1. the global batch of the step (data.py: a function of seed and step only) is split across the
     D replicas, and each replica's share into M micro-batches;
  2. GPipe schedule inside a replica: all micro-batches forward through the stages (activations
     sent to the same TP rank of the next stage), then all backward in reverse order (activation
     gradients sent back); tensor parallelism is the model's own (parallel.py's autograd-aware
     collectives);
  3. gradients are averaged across replicas (data parallel), a tied embedding/head pair split
     across first and last stage has its two gradients summed, the global gradient norm is
     clipped, and AdamW steps;
  4. every K steps the state is checkpointed asynchronously (checkpoint.py), in full-tensor
     coordinates, so any later layout can resume it.

Loss = mean token cross-entropy over the whole global batch, identical in every layout up to
floating-point summation order.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.crds.layout import RankLayout, RankPosition, split_layers
from shardwise.crds.modelshape import in_memory_dtype

from . import checkpoint as ckpt
from . import parallel
from .data import StepBatches, TokenDataset
from .errors import WorkerError

# A rank that waits longer than this for its peers in a collective fails instead of hanging.
_PG_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TrainOptions:
    model: str
    data: str
    checkpoint_dir: str
    steps: int
    tensor: int = 1
    pipeline: int = 1
    data_parallel: int = 1
    checkpoint_every: int = 0          # 0: only at the end
    keep: int = 3
    seed: int = 0
    lr: float = 3e-4
    warmup: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 8                # global: sequences per step over all replicas
    seq_len: int = 64
    micro_batches: int = 0             # per replica; 0: the pipeline degree (GPipe's usual choice)
    device: str = "cpu"
    dtype: str = "float32"
    async_checkpoint: bool = True
    json: bool = False
    stage_layers: list[tuple[int, int]] | None = None   # from a ShardPlan; None: the planner's split

    @property
    def layout(self) -> RankLayout:
        """Training is one world over all replicas: data-parallel replicas are RankLayout's replicas."""
        return RankLayout(self.tensor, self.pipeline, self.data_parallel)

    @property
    def world_size(self) -> int:
        return self.layout.world_size


class Groups:
    """Every process group training needs; all ranks create all of them in the same order."""

    def __init__(self, layout: RankLayout, pos: RankPosition, backend: str):
        T, P, D = layout.tensor, layout.pipeline, layout.replicas
        R = layout.rank
        self.tp = self.dp = self.mp = self.tie = None
        for r in range(D):
            for s in range(P):
                g = dist.new_group([R(r, s, t) for t in range(T)], backend=backend)
                if (r, s) == (pos.replica, pos.stage):
                    self.tp = g
        parallel.use_shm_allreduce(self.tp, _PG_TIMEOUT.total_seconds())     # a TP group shares a host
        for s in range(P):
            for t in range(T):
                g = dist.new_group([R(r, s, t) for r in range(D)], backend=backend)
                if (s, t) == (pos.stage, pos.tp_rank):
                    self.dp = g
        for r in range(D):
            g = dist.new_group([R(r, s, t) for s in range(P) for t in range(T)], backend=backend)
            if r == pos.replica:
                self.mp = g
        if P > 1:   # first and last stage hold the two copies of a tied embedding/head
            for r in range(D):
                for t in range(T):
                    g = dist.new_group([R(r, 0, t), R(r, P - 1, t)], backend=backend)
                    if r == pos.replica and t == pos.tp_rank:
                        self.tie = g
        # Checkpoint writes run in a background thread: their own gloo group keeps their
        # collectives from ever interleaving with the training collectives.
        self.checkpoint = dist.new_group(list(range(layout.world_size)), backend="gloo")


# ---------------------------------------------------------------- model state as full-tensor slices

def param_slices(model, prefix: str = "model/") -> dict[str, ckpt.Slice]:
    """This rank's parameters as slices of the full tensors, named by full (unsharded) names."""
    config = model.config
    out = {}
    for name, p in model.named_parameters():
        key = _full_name(model, name)
        out[prefix + key] = _slice(model, name, p.data, config)
    return out


def _full_name(model, name: str) -> str:
    # A tied head on the last stage (pipeline > 1) is a copy of the embedding: store it once.
    if name == "output.weight" and model.config.tie_word_embeddings:
        return "tok_embeddings.weight"
    return name


def _slice(model, name: str, local: torch.Tensor, config) -> ckpt.Slice:
    shard = getattr(model, "tp_shards", {}).get(name)
    if shard is None:
        return ckpt.Slice.whole(local)
    full_dim = config.vocab_size if shard.padded else local.shape[shard.dim] * shard.world
    start, stop = shard.bounds(full_dim)
    real = max(0, min(stop, full_dim) - start)   # vocabulary padding past the end is not stored
    full = list(local.shape)
    full[shard.dim] = full_dim
    offsets = tuple(start if d == shard.dim else 0 for d in range(local.dim()))
    return ckpt.Slice(local.narrow(shard.dim, 0, real), tuple(full), offsets)


def optimizer_slices(model, optimizer) -> dict[str, ckpt.Slice]:
    config = model.config
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        key = "optim/" + _full_name(model, name)
        out[key + "/exp_avg"] = _slice(model, name, state["exp_avg"], config)
        out[key + "/exp_avg_sq"] = _slice(model, name, state["exp_avg_sq"], config)
        out[key + "/step"] = ckpt.Slice.whole(state["step"])
    return out


def init_optimizer_state(model, optimizer) -> None:
    """Create AdamW's state up front so a checkpoint can be loaded into it in place."""
    for p in model.parameters():
        if p not in optimizer.state or not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


# ---------------------------------------------------------------- one training step

class Trainer:
    def __init__(self, opts: TrainOptions, rank: int, emit: Callable[[dict], None] | None = None):
        from .loader import DTYPES, check_layout, load_stage, open_model

        self.opts, self.rank = opts, rank
        self.layout = opts.layout
        self.pos = self.layout.position(rank)
        self.device = torch.device(opts.device if opts.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.emit = emit or (lambda rec: None)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups = Groups(self.layout, self.pos, backend)

        source = open_model(opts.model)
        self.source = source
        self.config = source.config
        # "auto" (the ShardedModel default): the rule the planner sized the job by
        self.dtype = DTYPES[in_memory_dtype(opts.dtype, source.dtype, self.device.type)]
        check_layout(self.config, opts.tensor, opts.pipeline)
        ranges = opts.stage_layers or split_layers(self.config.facts(), opts.pipeline).ranges
        s, P = self.pos.stage, opts.pipeline
        self.first, self.last = s == 0, s == P - 1
        self.model = load_stage(source, ranges[s][0], ranges[s][1], self.first, self.last,
                                self.pos.tp_rank, opts.tensor, self.groups.tp, self.device, self.dtype)
        self.model.train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.params = list(dict.fromkeys(self.model.parameters()))   # a tied pair once
        self.optimizer = torch.optim.AdamW(self.params, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=opts.weight_decay, foreach=False)
        init_optimizer_state(self.model, self.optimizer)

        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(source)
        self.data = TokenDataset.from_file(opts.data, tokenizer.encode)
        self.batches = StepBatches(self.data, opts.seq_len, opts.batch_size, opts.seed)
        per_replica = opts.batch_size // opts.data_parallel
        self.micro = opts.micro_batches or min(opts.pipeline, per_replica)
        if opts.batch_size % opts.data_parallel or per_replica % self.micro:
            raise WorkerError(f"--batch-size {opts.batch_size} must split evenly into {opts.data_parallel} "
                              f"replicas x {self.micro} micro-batches")
        self.manager = ckpt.CheckpointManager(
            opts.checkpoint_dir, rank=rank, group=self.groups.checkpoint,
            model_meta=ckpt.structure_of(self.config.to_dict()), keep=opts.keep,
            asynchronous=opts.async_checkpoint, log=lambda m: self.emit({"event": "log", "message": m}),
            files=model_files(source, tokenizer))
        self.step = 0

    # -- state
    def state_slices(self) -> dict[str, ckpt.Slice]:
        return {**param_slices(self.model), **optimizer_slices(self.model, self.optimizer)}

    def resume(self) -> dict | None:
        meta = self.manager.load_latest(self.state_slices(), agree=self._agree)
        if meta is None:
            return None
        self.step = int(meta["step"])
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
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.groups.checkpoint)
        return int(t.item())

    def save(self) -> None:
        extra = {"data": self.batches.position(self.step), "rng": ckpt.rng_to_text(torch.get_rng_state()),
                 "model_config": self.config.to_dict(),
                 "layout": {"tensor": self.opts.tensor, "pipeline": self.opts.pipeline,
                            "data_parallel": self.opts.data_parallel}}
        self.manager.save(self.step, self.state_slices(), extra)

    # -- pipeline plumbing
    def _peer(self, stage: int) -> int:
        return self.layout.rank(self.pos.replica, stage, self.pos.tp_rank)

    def train_step(self) -> dict:
        step = self.step + 1
        opts, s = self.opts, self.pos.stage
        batch = self.batches.batch(step, self.pos.replica, opts.data_parallel).to(self.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        mbs = list(zip(inputs.chunk(self.micro), targets.chunk(self.micro)))
        hidden = self.config.hidden_size
        for p in self.params:
            p.grad = None
        lr = opts.lr * min(1.0, step / opts.warmup) if opts.warmup else opts.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        saved, loss_sum = [], torch.zeros((), dtype=torch.float32, device=self.device)
        for x, y in mbs:                                    # forward, all micro-batches
            if self.first:
                inp = x
            else:
                inp = torch.empty((x.shape[0], x.shape[1], hidden), dtype=self.dtype, device=self.device)
                dist.recv(inp, self._peer(s - 1))
                inp.requires_grad_(True)
            out = self.model(inp)
            if self.last:
                loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1)) / self.micro
                loss_sum += loss.detach()
                saved.append((inp, loss))
            else:
                dist.send(out.detach().contiguous(), self._peer(s + 1))
                saved.append((inp, out))
        for inp, out in reversed(saved):                 # backward, in reverse order
            if self.last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, self._peer(s + 1))
                out.backward(grad)
            if not self.first:
                dist.send(inp.grad.contiguous(), self._peer(s - 1))

        self._sync_grads()
        norm = self._clip()
        self.optimizer.step()
        self.step = step
        # Mean loss over the global batch: the last stage's TP rank 0 of each replica contributes.
        report = loss_sum if (self.last and self.pos.tp_rank == 0) else torch.zeros_like(loss_sum)
        dist.all_reduce(report)
        return {"step": step, "loss": report.item() / opts.data_parallel, "lr": lr, "grad_norm": norm}

    def _sync_grads(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.opts.data_parallel > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups.dp)
            flat /= self.opts.data_parallel
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.groups.tie is not None and self.config.tie_word_embeddings:
            tied = self.model.tok_embeddings.weight if self.first else self.model.output.weight
            dist.all_reduce(tied.grad, group=self.groups.tie)

    def _clip(self) -> float:
        """Global gradient norm over the whole model (each element counted once), clipped."""
        shards = self.model.tp_shards
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if name == "output.weight" and self.config.tie_word_embeddings:
                continue   # the tied copy: its gradient is the embedding's, counted on stage 0
            if name in shards or self.pos.tp_rank == 0:   # replicated: count on one TP rank
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq, group=self.groups.mp)
        norm = math.sqrt(sq.item())
        if self.opts.grad_clip and norm > self.opts.grad_clip:
            scale = self.opts.grad_clip / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm


def model_files(source, tokenizer) -> dict[str, bytes]:
    """Config and tokenizer files a checkpoint carries, so that it serves as a model by itself.

    From an HF folder (or an earlier checkpoint) they are copied; a GGUF model's tokenizer, built
    from the GGUF metadata, is written out as tokenizer.json."""
    files = {}
    folder = Path(source.path)
    if folder.is_dir():
        for name in ckpt.MODEL_FILES:
            if (folder / name).is_file():
                files[name] = (folder / name).read_bytes()
    if "tokenizer.json" not in files and hasattr(tokenizer, "tok"):
        files["tokenizer.json"] = tokenizer.tok.to_str().encode()
    return files


# ---------------------------------------------------------------- entry point for one rank

def run_training(opts: TrainOptions, rank: int | None = None, world_size: int | None = None,
                 out=sys.stdout, on_started: Callable[["Trainer"], None] | None = None) -> int:
    """Train as one rank of a world of T*P*D processes (torchrun variables if not given).

    This is what `shardwise train` runs in each local process and what a training pod's
    `shardwise worker` calls. Rank 0 prints progress (JSON lines with --json) and writes
    `<checkpoint_dir>/progress.json`. `on_started(trainer)` is called once this rank has joined
    the world and loaded its slice (resumed from a checkpoint, if there was one). Returns 0 when
    all steps are done and the last checkpoint is committed.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size != opts.world_size:
        raise WorkerError(f"{world_size} processes for a layout of {opts.tensor} tensor x {opts.pipeline} "
                          f"pipeline x {opts.data_parallel} data parallel = {opts.world_size} ranks")
    torch.manual_seed(opts.seed)
    if not dist.is_initialized():
        # CUDA: NCCL for tensors on the GPU, gloo for the CPU-side agreement and checkpoint groups
        backend = "cpu:gloo,cuda:nccl" if opts.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=_PG_TIMEOUT)
    lead = rank == 0
    # Warnings (a damaged checkpoint skipped, another dataset) as one line each, from rank 0 only.
    warnings.showwarning = lambda message, *a, **k: (
        print(f"warning: {message}", file=sys.stderr, flush=True) if lead else None)

    def emit(rec: dict) -> None:
        if not lead:
            return
        if opts.json:   # stdout: exactly one object per step; other news as text on stderr
            if "loss" in rec:
                print(json.dumps(rec), file=out, flush=True)
            elif rec.get("message"):
                print(rec["message"], file=sys.stderr, flush=True)
        elif "loss" in rec:
            extra = f"  checkpoint {rec['checkpoint']}" if rec.get("checkpoint") else ""
            print(f"step {rec['step']:>6}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                  f"grad-norm {rec['grad_norm']:.3f}  {rec['tokens_per_s']:.0f} tok/s{extra}", file=out, flush=True)
        elif rec.get("event") in ("resume", "start", "done", "log"):
            print(rec.get("message", json.dumps(rec)), file=out, flush=True)

    try:
        trainer = Trainer(opts, rank, emit)
        meta = trainer.resume()
        if meta is not None:
            emit({"event": "resume", "step": trainer.step, "from_layout": meta.get("layout"),
                  "message": f"resumed from checkpoint step {trainer.step} "
                             f"(saved under {_layout_text(meta.get('layout'))}, now {_layout_text(dataclasses.asdict(opts))})"})
        else:
            emit({"event": "start", "step": 0, "message": f"training from {opts.model} "
                  f"({_layout_text(dataclasses.asdict(opts))}, {len(trainer.data)} tokens)"})
        if on_started is not None:
            on_started(trainer)
        if lead:
            Path(opts.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        tokens_per_step = opts.batch_size * opts.seq_len
        last_loss = None
        while trainer.step < opts.steps:
            t0 = time.perf_counter()
            rec = trainer.train_step()
            last_loss = rec["loss"]
            every = opts.checkpoint_every
            saving = (every and trainer.step % every == 0) or trainer.step == opts.steps
            if saving:
                trainer.save()
                rec["checkpoint"] = ckpt.step_dir_name(trainer.step)
                rec["checkpoint_blocking_s"] = round(trainer.manager.last_blocking_s, 4)
            rec["tokens_per_s"] = tokens_per_step / (time.perf_counter() - t0)
            emit(rec)
            if lead:
                _write_progress(opts, trainer, rec)
        trainer.manager.wait()
        if lead:
            _write_progress(opts, trainer, {"step": trainer.step, "done": True,
                                            "loss": last_loss})
        emit({"event": "done", "step": trainer.step,
              "message": f"done: {trainer.step} steps, last checkpoint "
                         f"{ckpt.step_dir_name(trainer.step)} in {opts.checkpoint_dir}"})
        dist.barrier()
        return 0
    finally:
        if dist.is_initialized():
            parallel.close_shm_allreduces()
            dist.destroy_process_group()


def _write_progress(opts: TrainOptions, trainer: Trainer, rec: dict) -> None:
    last = trainer.manager.last_committed
    progress = {"step": trainer.step, "steps": opts.steps, "loss": rec.get("loss"),
                "done": bool(rec.get("done")), "time": time.time(),
                "last_checkpoint": None if last is None else {"step": last[0], "time": last[1],
                                                              "name": ckpt.step_dir_name(last[0])}}
    tmp = Path(opts.checkpoint_dir) / ".progress.json.tmp"
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, Path(opts.checkpoint_dir) / "progress.json")


def _layout_text(d: dict | None) -> str:
    if not d:
        return "unknown layout"
    return f"TP={d.get('tensor')} PP={d.get('pipeline')} DP={d.get('data_parallel')}"


# ---------------------------------------------------------------- pods: training from a ShardPlan

def options_from_plan(plan, *, model: str, data: str, steps: int, checkpoint_dir: str,
                      **more) -> TrainOptions:
    """Training options for a ShardedModel's pods: the layout (T, P, replicas as DP) and each
    stage's layer range come from the plan; the rest from the spec (passed as keywords with
    TrainOptions' names, e.g. checkpoint_every=100, lr=1e-4)."""
    stages = plan.stages_of(0) if plan.placements else []
    layers = [(p.layer_start, p.layer_end) for p in stages] or None
    return TrainOptions(model=model, data=data, steps=steps, checkpoint_dir=checkpoint_dir,
                        tensor=plan.tensor, pipeline=plan.pipeline, data_parallel=max(1, plan.replicas),
                        stage_layers=layers, **more)


def pod_rank(replica: int, stage: int, local_rank: int, plan) -> int:
    """The global training rank of a GPU in a pod (torchrun --node-rank = replica*P + stage)."""
    return RankLayout(plan.tensor, plan.pipeline, max(1, plan.replicas)).rank(replica, stage, local_rank)


def last_checkpoint(checkpoint_dir: str) -> dict | None:
    """What a status report shows: step and time of the newest complete checkpoint, or None."""
    found = ckpt.latest_complete(checkpoint_dir)
    if found is None:
        return None
    step, path, meta = found
    return {"step": step, "time": meta.get("time"), "path": str(path)}


def options_from_contract(contract, *, device: str, dtype: str) -> TrainOptions:
    """TrainOptions of a training pod, from its pod contract (crds/contract.py): the one mapping
    from spec.training and spec.checkpoint to TrainOptions' names. `device` and `dtype` are what
    the pod resolved (the contract's dtype may be auto)."""
    t, c = contract.training, contract.checkpoint
    return options_from_plan(
        contract.plan, model=contract.model.path, data=t.data, steps=t.steps, checkpoint_dir=c.path,
        checkpoint_every=c.interval_steps, keep=c.keep, seed=t.seed, lr=t.learning_rate,
        warmup=t.warmup_steps, weight_decay=t.weight_decay, batch_size=t.batch_size, seq_len=t.seq_length,
        micro_batches=t.micro_batches or 0, device=device, dtype=dtype, json=True)


def run_training_rank(opts: TrainOptions, plan, replica: int, stage: int, local_rank: int,
                      on_started: Callable[["Trainer"], None] | None = None) -> int:
    """A training pod's rank process: `opts` from options_from_contract, global rank from
    (replica, stage, local GPU). MASTER_ADDR/MASTER_PORT must name replica 0, stage 0."""
    if opts.device == "cuda":
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    return run_training(opts, rank=pod_rank(replica, stage, local_rank, plan), world_size=opts.world_size,
                        on_started=on_started)


def read_progress(checkpoint_dir: str) -> dict | None:
    """`<checkpoint_dir>/progress.json` as rank 0 last wrote it, or None (not started, unreadable)."""
    try:
        return json.loads((Path(checkpoint_dir) / "progress.json").read_text())
    except (OSError, ValueError):
        return None
