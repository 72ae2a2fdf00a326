"""Layers kept in host memory and streamed to the device ahead of their turn (`--offload-budget`).

When a stage's weights do not fit the device memory it may use for them, the first layers that
fit stay resident; every other decoder layer lives in (pinned) host memory, packed into one buffer
per layer, and runs from one of two device slots: while layer i computes in one slot, layer i+1
is copied into the other on a separate CUDA stream, so the copy overlaps the compute (double
buffering). After the last streamed layer of a step the first one is fetched again, overlapped
with the next step's resident layers. On CPU the same code runs with synchronous copies, so the
path is testable without a GPU.

Applied to the unchanged model from outside, after loading (and tensor-parallel slicing, fusing,
quantizing): each layer's tensors are re-pointed at the slot that holds it just before it runs
(Transformer.before_layer). Layers of a Llama-family model are alike, so every streamed layer
has the same packing and any slot holds any of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.worker.errors import WorkerError

ALIGN = 256      # bytes; every tensor in a packed layer starts on a boundary a copy engine likes
MiB = 2 ** 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a layer: where it sits in the layer's packed buffer."""
    path: str                 # module path inside the layer, "" for the layer itself
    name: str                 # parameter or buffer name on that module
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def layer_tensors(layer: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(module path, name, tensor) of a layer's weights: its parameters and buffers, not a KV cache."""
    out = []
    for path, module in layer.named_modules():
        if "kv_cache" in path.split("."):
            continue
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out.append((path, name, t))
    return out


def packing(layer: nn.Module) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for path, name, t in layer_tensors(layer):
        entries.append(Entry(path, name, offset, tuple(t.shape), t.dtype))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return entries, offset


def tensor_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class OffloadPlan:
    resident: tuple[str, ...]     # layer names kept on the device
    streamed: tuple[str, ...]     # layer names streamed through the two slots
    layer_bytes: int              # one packed layer (a slot's size)
    fixed_bytes: int              # weights outside the decoder layers (embedding, head, norm)

    @property
    def device_bytes(self) -> int:
        slots = 2 * self.layer_bytes if self.streamed else 0
        return self.fixed_bytes + len(self.resident) * self.layer_bytes + slots


def plan_offload(model: nn.Module, budget: int) -> OffloadPlan:
    """Which layers stay on the device under a budget of `budget` bytes of weights; one line
    naming the smallest budget that works when it is too small even for two slots."""
    names = list(model.layers.keys())
    layer_bytes = packing(model.layers[names[0]])[1] if names else 0
    fixed = tensor_bytes(model) - sum(tensor_bytes(layer) for layer in model.layers.values())
    if fixed + len(names) * layer_bytes <= budget:
        return OffloadPlan(tuple(names), (), layer_bytes, fixed)
    smallest = fixed + 2 * layer_bytes
    if budget < smallest:
        raise WorkerError(
            f"offload budget {budget / MiB:.1f} MiB is below the smallest that works for this stage, "
            f"{-(-smallest // MiB)} MiB: the weights outside the decoder layers ({fixed / MiB:.1f} MiB) "
            f"and two layers ({layer_bytes / MiB:.1f} MiB each) to stream through")
    resident = min(len(names) - 1, (budget - smallest) // layer_bytes)
    return OffloadPlan(tuple(names[:resident]), tuple(names[resident:]), layer_bytes, fixed)


class LayerStreamer:
    """Runs a model's streamed layers from two device slots (see the module docstring)."""

    def __init__(self, model: nn.Module, plan: OffloadPlan, device: torch.device):
        self.model, self.plan, self.device = model, plan, torch.device(device)
        self.order = list(plan.streamed)
        self.entries, size = packing(model.layers[self.order[0]])
        self.cuda = self.device.type == "cuda"
        pin = self.cuda and torch.cuda.is_available()
        self.host: dict[str, torch.Tensor] = {}
        for name in self.order:
            layer = model.layers[name]
            if packing(layer)[0] != self.entries:
                raise WorkerError(f"layer {name} is shaped unlike layer {self.order[0]}: it cannot be streamed")
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            for e, (_, _, t) in zip(self.entries, layer_tensors(layer)):
                self._view(buf, e).copy_(t.detach())
            self.host[name] = buf
            for e in self.entries:     # the layer's own copy goes; its tensors point at a slot later
                self._bind(layer, e, torch.empty(0, dtype=e.dtype))
        self.in_slot: list[str | None] = [None, None]
        self.current = 1                 # the slot the layer running now reads (the first goes to 0)
        self.copied = [None, None]       # CUDA: event after each slot's last copy
        self.released = [None, None]     # CUDA: event after the compute that last read each slot
        self.copy_bytes = 0              # bytes streamed so far (benchmarks)

    @staticmethod
    def _view(buf: torch.Tensor, e: Entry) -> torch.Tensor:
        return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def _bind(self, layer: nn.Module, e: Entry, tensor: torch.Tensor) -> None:
        module = layer.get_submodule(e.path) if e.path else layer
        current = getattr(module, e.name)
        current.data = tensor

    def start(self) -> None:
        """Once the model is on its device: the slots, and the first streamed layer on its way."""
        size = self.host[self.order[0]].numel()
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._copy(self.order[0], 0)

    def _copy(self, name: str, s: int) -> None:
        """Copy layer `name` into slot `s`, once the compute that last read slot `s` is done."""
        if self.in_slot[s] == name:
            return
        src, dst = self.host[name], self.slots[s]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self.released[s] is not None:
                    self.copy_stream.wait_event(self.released[s])
                dst.copy_(src, non_blocking=True)
                self.copied[s] = torch.cuda.Event()
                self.copied[s].record(self.copy_stream)
        else:
            dst.copy_(src)
        self.in_slot[s] = name
        self.copy_bytes += src.numel()

    def before_layer(self, name: str) -> None:
        """Called by Transformer.run_layers before each layer runs: layer `name` in a slot, its
        tensors pointing there, and the next streamed layer on its way into the other slot."""
        if name not in self.host:
            return
        s = self.in_slot.index(name) if name in self.in_slot else 1 - self.current
        self._copy(name, s)             # a no-op when the previous layer prefetched it
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[s])
        layer = self.model.layers[name]
        for e in self.entries:
            self._bind(layer, e, self._view(self.slots[s], e))
        other = 1 - s
        if self.cuda:
            # Everything queued so far, the previous layer that read the other slot included: once
            # done, the next layer may overwrite that slot.
            self.released[other] = torch.cuda.Event()
            self.released[other].record(torch.cuda.current_stream(self.device))
        self.current = s
        self._copy(self.order[(self.order.index(name) + 1) % len(self.order)], other)


def apply_offload(model: nn.Module, budget: int, device) -> OffloadPlan:
    """Keep what fits `budget` bytes of weights on `device` and stream the rest (see above). The
    model comes loaded in host memory; what stays resident moves to `device` here."""
    plan = plan_offload(model, budget)
    streamer = LayerStreamer(model, plan, device) if plan.streamed else None   # streamed layers leave
    model.to(device)
    if streamer is not None:
        streamer.start()
        model.before_layer = streamer.before_layer
    return plan


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes; one line on anything else."""
    units = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}
    s = text.strip().lower()
    number = s.rstrip("kmgib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value < 0:
        raise WorkerError(f"offload budget {text!r} is not a size (examples: 512MiB, 2GiB, 1.5GB)")
    return int(value * units[unit])
