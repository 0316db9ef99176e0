"""Whole-step CUDA graph capture (forward, backward, grad clip, optimizer step).

Follows PyTorch's whole-network capture recipe: a few eager steps on a side stream (allocations
and compilation happen there), gradients set to None right before capture so the captured
backward *writes* fresh gradients into the graph's pool on every replay (never zero them after
capture: that would drop the static gradient tensors), then copy each batch into the static
inputs and replay. Every call performs exactly one optimizer step, eager or replayed, so the
loss sequence matches an uncaptured run. The step's item count (the loss divisor) is a static
input too, so batches of one shape but other counts (ignored labels) replay correctly. With ``memset_kernels`` the graph is kept after capture,
its small memset nodes are rewritten as kernel nodes (run/graph_memsets.py), and only then
instantiated; ``report`` receives a line saying what the rewrite did.
"""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from ..errors import FasttrainError, first_line
from ..workloads.base import Batch
from .graph_memsets import rewrite_then_instantiate


T = TypeVar("T")


def record(body: Callable[[], T], memset_kernels: bool, refused: str,
           stream: Optional[torch.cuda.Stream] = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``body()`` captured in a new CUDA graph, and what it returned. With ``memset_kernels`` the
    graph is kept for editing: the caller rewrites its memsets and instantiates it
    (``rewrite_then_instantiate``). A RuntimeError inside the capture (a host sync, a copy to
    the CPU) becomes one line: ``refused``, its ``{first}`` the error's first line.
    ``thread_local``: another thread querying CUDA events (a DataLoader's pin-memory thread)
    would invalidate a capture in the default, global mode."""
    graph = torch.cuda.CUDAGraph(keep_graph=True) if memset_kernels else torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = body()
    except RuntimeError as err:
        raise FasttrainError(refused.format(first=first_line(err))) from None
    return graph, out


class GraphedStep:
    def __init__(self, core: Callable[[Batch, torch.Tensor], torch.Tensor], optimizer, eager_steps: int = 3,
                 memset_kernels: bool = False,
                 report: Optional[Callable[[str], None]] = None):
        self.core, self.optimizer, self.eager_steps = core, optimizer, eager_steps
        self.memset_kernels, self.report = memset_kernels, report
        self.static: Batch | None = None
        self.static_count: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_loss: torch.Tensor | None = None
        self.calls = 0
        # One side stream for every eager warm-up step: the caching allocator reuses blocks only
        # within a stream, so a new stream per step would hold several copies of the activations.
        self.side = torch.cuda.Stream()

    def _load(self, batch: Batch, count: torch.Tensor) -> None:
        if self.static is None:
            self.static = {k: v.clone() for k, v in batch.items()}
            self.static_count = count.detach().clone()
            return
        if batch.keys() != self.static.keys():
            raise FasttrainError(f"cuda_graphs replays one batch layout: this batch has fields "
                                 f"{sorted(batch)}, the captured one {sorted(self.static)}")
        for k, v in batch.items():
            if v.shape != self.static[k].shape or v.dtype != self.static[k].dtype:
                raise FasttrainError(
                    f"cuda_graphs replays one batch shape: {k} is {tuple(v.shape)} {v.dtype}, "
                    f"the captured one {tuple(self.static[k].shape)} {self.static[k].dtype}; "
                    "keep every batch one shape (drop_last, fixed-length padding) or turn "
                    "cuda_graphs off")
            self.static[k].copy_(v, non_blocking=True)
        self.static_count.copy_(count, non_blocking=True)

    def __call__(self, batch: Batch, count: torch.Tensor) -> torch.Tensor:
        self._load(batch, count)
        self.calls += 1
        if self.calls <= self.eager_steps:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.core(self.static, self.static_count)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            self.optimizer.zero_grad(set_to_none=True)
            self.graph, self.static_loss = record(
                lambda: self.core(self.static, self.static_count), self.memset_kernels,
                "cuda_graphs: the step could not be captured ({first}): the model's forward or "
                "loss waits for the GPU (.item(), a print or an if on a tensor, a copy to the "
                "CPU, a shape that depends on the data); take that out of the step or turn "
                "cuda_graphs off")
            if self.memset_kernels:
                self._rewrite()
        self.graph.replay()
        return self.static_loss.clone()

    def _rewrite(self) -> None:
        """The captured graph's small memsets as kernel nodes, then instantiate it."""
        note = rewrite_then_instantiate(self.graph)
        if self.report is not None:
            self.report(note)
