"""Whole-step CUDA graph capture (forward, backward, grad clip, optimizer step).

Follows PyTorch's whole-network capture recipe: a few eager steps on a side stream (allocations
and compilation happen there), gradients set to None right before capture so the captured
backward *writes* fresh gradients into the graph's pool on every replay (never zero them after
capture: that would drop the static gradient tensors), then copy each batch into the static
inputs and replay. Every call performs exactly one optimizer step, eager or replayed, so the
loss sequence matches an uncaptured run. With ``memset_kernels`` the graph is kept after capture,
its small memset nodes are rewritten as kernel nodes (run/graph_memsets.py), and only then
instantiated; ``report`` receives a line saying what the rewrite did.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import FasttrainError
from ..workloads.base import Batch
from .graph_memsets import GraphRewriteError, rewrite


class GraphedStep:
    def __init__(self, core: Callable[[Batch], torch.Tensor], optimizer, eager_steps: int = 3,
                 memset_kernels: bool = False,
                 report: Optional[Callable[[str], None]] = None):
        self.core, self.optimizer, self.eager_steps = core, optimizer, eager_steps
        self.memset_kernels, self.report = memset_kernels, report
        self.static: Batch | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_loss: torch.Tensor | None = None
        self.calls = 0
        # One side stream for every eager warm-up step: the caching allocator reuses blocks only
        # within a stream, so a new stream per step would hold several copies of the activations.
        self.side = torch.cuda.Stream()

    def _load(self, batch: Batch) -> None:
        if self.static is None:
            self.static = {k: v.clone() for k, v in batch.items()}
            return
        for k, v in batch.items():
            if v.shape != self.static[k].shape:
                raise FasttrainError(
                    f"cuda_graphs replays one batch shape: {k} is {tuple(v.shape)}, the captured "
                    f"one {tuple(self.static[k].shape)}; every batch must keep one shape")
            self.static[k].copy_(v, non_blocking=True)

    def __call__(self, batch: Batch) -> torch.Tensor:
        self._load(batch)
        self.calls += 1
        if self.calls <= self.eager_steps:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.core(self.static)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph(keep_graph=True) if self.memset_kernels \
                else torch.cuda.CUDAGraph()
            # thread_local: the DataLoader's pin-memory thread keeps querying CUDA events while
            # the main thread captures; in the default (global) mode that invalidates the capture.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.static_loss = self.core(self.static)
            if self.memset_kernels:
                self._rewrite()
        self.graph.replay()
        return self.static_loss.clone()

    def _rewrite(self) -> None:
        """The captured graph's small memsets as kernel nodes, then instantiate it."""
        try:
            r = rewrite(self.graph)
            note = (f"{r.rewritten} of the graph's {r.nodes} nodes were memsets, now kernels"
                    + (f"; {r.kept} larger memsets kept" if r.kept else ""))
        except GraphRewriteError as err:  # the nodes not yet replaced stay memsets
            note = f"rewrite stopped ({err}); the rest of the graph as captured"
        self.graph.instantiate()
        if self.report is not None:
            self.report(note)
