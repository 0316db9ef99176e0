"""Per-submodule forward (and backward) time inside the real training loop.

Forward pre/post hooks on each top-level submodule record CUDA events (host clock on CPU);
backward is timed per trainable submodule with full backward pre/post hooks where PyTorch fires
both. Hooks run on chosen steps only, so the overhead they add is measured by comparing those
steps with unhooked ones (reported, not assumed).
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch
from torch import nn

from ..run.loop import Observer
from ..measure.timer import elapsed, timestamp
from ..techniques.base import TrainState


def timed_children(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Top-level submodules by name; a ModuleList/Dict is timed through its items."""
    out: dict[str, list[nn.Module]] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            items = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
            if items:
                out[name] = items
        elif any(True for _ in child.parameters()):
            out[name] = [child]
    return out


class ModuleTimer(Observer):
    """Hooks on top-level submodules during steps in ``active`` (a set of step indices)."""

    name = "modules"

    def __init__(self, active: set[int]):
        self.active = active
        self.on = False
        self.spans: dict[int, list[tuple[str, str, object, object]]] = defaultdict(list)
        self.handles: list = []
        self.cuda = False
        self._stack: dict[tuple[str, str, int], object] = {}
        self.step = -1
        self.skipped: str | None = None
        # A module none of whose inputs needs grad gets its backward post-hook early (PyTorch
        # fires it at the output gradients), so its backward span is meaningless: dropped, and
        # the backward phase is attributed to it when it is the only trainable submodule.
        self.no_input_grad: set[str] = set()
        self.trainable_names: list[str] = []
        self._filters = None

    def _now(self):
        return timestamp(self.cuda)

    def _open(self, name: str, kind: str, mod: nn.Module):
        if self.on:
            self._stack[(name, kind, id(mod))] = self._now()

    def _fwd_done(self, name: str, mod: nn.Module, args) -> None:
        if self.on and not any(torch.is_tensor(a) and a.requires_grad for a in args):
            self.no_input_grad.add(name)
        self._close(name, "fwd", mod)

    def _close(self, name: str, kind: str, mod: nn.Module):
        start = self._stack.pop((name, kind, id(mod)), None) if self.on else None
        if start is not None:
            self.spans[self.step].append((name, kind, start, self._now()))

    def attach(self, state: TrainState) -> None:
        import warnings

        self.cuda = state.cuda
        self._filters = warnings.filters[:]
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        if state.recipe.compile != "none" or state.recipe.cuda_graphs:
            self.skipped = "per-module timing needs an eager forward (compile/graphs are on)"
            return
        trainable = {id(p) for p in state.trainable.parameters() if p.requires_grad}
        for name, mods in timed_children(state.model).items():
            for mod in mods:
                self.handles += [
                    mod.register_forward_pre_hook(lambda m, a, n=name: self._open(n, "fwd", m)),
                    mod.register_forward_hook(lambda m, a, o, n=name: self._fwd_done(n, m, a))]
                if any(id(p) in trainable for p in mod.parameters()):
                    if name not in self.trainable_names:
                        self.trainable_names.append(name)
                    self.handles += [
                        mod.register_full_backward_pre_hook(
                            lambda m, g, n=name: self._open(n, "bwd", m)),
                        mod.register_full_backward_hook(
                            lambda m, gi, go, n=name: self._close(n, "bwd", m))]

    def begin(self, step: int) -> None:
        self.step, self.on = step, step in self.active

    def end(self, step: int) -> None:
        self.on = False
        self._stack.clear()

    def report(self) -> dict:
        import warnings

        for h in self.handles:
            h.remove()
        if self._filters is not None:
            warnings.filters[:] = self._filters
        if self.skipped:
            return {"skipped": self.skipped}
        if self.cuda:
            torch.cuda.synchronize()
        per_step: list[dict[str, float]] = []
        for step in sorted(self.spans):
            acc: dict[str, float] = defaultdict(float)
            for name, kind, a, b in self.spans[step]:
                if kind == "bwd" and name in self.no_input_grad:
                    continue
                acc[f"{name} {kind}"] += elapsed(a, b, self.cuda)
            per_step.append(acc)
        keys = sorted({k for d in per_step for k in d})
        sole = self.trainable_names[0] if len(self.trainable_names) == 1 else None
        return {"module_s": {k: statistics.fmean(d.get(k, 0.0) for d in per_step) for k in keys},
                "steps": sorted(self.spans), "sole_trainable": sole}
