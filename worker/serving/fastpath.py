"""The compiled decode step on CPU (`--decode compile`), applied to the model from outside.

`compile_decode(model)` puts a torch.compile of the model's `run_layers` (the layers, the final
norm and the head; inductor's C++ code on CPU) on the instance, used for decode steps (one new
token per row, cached): norms, RoPE, cache writes, attention and SwiGLU become a few fused kernels
between the weight matmuls. The step's bookkeeping (the cache view, cache_view.py: host-side ints
and checks) stays eager, so the compiled graph has no breaks. Lengths and batch sizes are
symbolic; it compiles again for each kind of step (one row or several, with or without a mask or
a gather of cache rows), which takes a while on first use (docs/worker.md, Benchmark).
"""
from __future__ import annotations

from types import MethodType

import torch

from shardwise.worker.model.attention import CacheStep


def compile_decode(model) -> None:
    """Run `model`'s (llama.Transformer) decode steps compiled; other steps stay eager."""
    model.run_layers = CompiledDecode(model)


class CompiledDecode:
    """torch.compile of Transformer.run_layers for decode steps, with the guard checks of a
    single-stream step skipped once that kind of step has run.

    Before each call torch.compile checks every module attribute and weight it read, a cost a
    single row pays on every step. Skipping them is safe only where nothing they check can change
    between calls, so it is limited to steps of one row at cache row 0 with no mask: there the
    only symbolic size is the attended length, whose single guard (2 <= length <= max_seq) every
    decode step meets, and the model's weights and caches are fixed: new caches (setup_caches)
    bring the guard checks back until that kind of step has run on them. Several rows keep every
    guard: their sizes can coincide (batch size and length), which torch.compile guards on."""

    def __init__(self, model):
        self.model = model
        self.eager = MethodType(type(model).run_layers, model)      # the class's, not this wrapper
        self.compiled = torch.compile(self.eager, dynamic=True)
        self.caches = None                  # the caches the single-row step last ran on
        self.single_row_ran = False
        # One context manager, entered for each step: making one costs more than entering it.
        # Making it also sets the stance at once, so the previous one is put back here.
        self.skip_guards = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        self.skip_guards.__exit__(None, None, None)

    def __call__(self, h, cos, sin, step: CacheStep | None, return_hidden: bool = False, last_only: bool = False):
        if step is None or h.shape[1] != 1:
            return self.eager(h, cos, sin, step, return_hidden, last_only)
        caches = self.current_caches()
        if caches is not self.caches:
            self.caches, self.single_row_ran = caches, False
        single_row = h.shape[0] == 1 and step.mask is None and step.start == 0 and step.length >= 2
        if not (single_row and self.single_row_ran):
            out = self.compiled(h, cos, sin, step, return_hidden, last_only)
            self.single_row_ran = self.single_row_ran or single_row
            return out
        with self.skip_guards:
            return self.compiled(h, cos, sin, step, return_hidden, last_only)

    def current_caches(self):
        """The first layer's KV cache: a new object whenever setup_caches made new caches."""
        first = next(iter(self.model.layers.values()), None)
        return first.attention.kv_cache if first is not None else None
