"""The forward replayed from CUDA graphs that fasttrain captures itself, memsets as kernels.

``torch.compile(mode="reduce-overhead")`` records its CUDA graphs through cudagraph trees and
replays them as captured. :class:`CapturedForward` records the forward (compiled without graphs,
or eager) with ``torch.cuda.CUDAGraph``, one graph per input shape and dtype, and before
instantiating each rewrites its small memset nodes as kernel nodes (``run/graph_memsets.py``):
cuBLAS and cuDNN zero a few bytes of workspace before many of their GEMMs, and on the GPU a
kernel that waits on a memset node starts about 3 µs after the kernel before it, one that waits
on a kernel about 0.4 µs after it. Numerics: none (the same kernels on the same bytes).

A call copies the input into the graph's static input, replays, and returns a copy of the
static output, so an output stays valid after the next call, as an uncaptured forward's does.
The first call at a new shape runs the forward ``warmup`` times on a side stream (compilation
and autotuning happen there, outside the capture) and then captures it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import FasttrainError
from ..run.graph_memsets import rewrite_then_instantiate
from ..techniques.graph_memsets import keeps_graph

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor


class CapturedForward:
    """``forward`` replayed from one CUDA graph per input shape; ``applied["capture"]`` says,
    after each capture, what the memset rewrite did."""

    def __init__(self, forward: Forward, applied: dict[str, Any], warmup: int = 3,
                 memset_kernels: bool = True):
        if warmup < 1:
            raise FasttrainError(f"CapturedForward needs at least one warm-up call, not {warmup}")
        self.forward, self.applied = forward, applied
        self.warmup, self.memset_kernels = warmup, memset_kernels and keeps_graph()
        self.graphs: dict[tuple, _Captured] = {}
        self.notes: dict[str, str] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            raise FasttrainError(f"a captured forward runs on a CUDA GPU; its input is on "
                                 f"{x.device}")
        key = (tuple(x.shape), x.dtype, x.device)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(x)
        else:
            entry.static_in.copy_(x, non_blocking=True)
        entry.graph.replay()
        return entry.static_out.clone()

    def _capture(self, x: torch.Tensor) -> _Captured:
        static_in = x.clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.forward(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.memset_kernels \
            else torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = self.forward(static_in)
        except RuntimeError as err:  # a host sync or a CPU copy inside the forward
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise FasttrainError(
                f"the forward could not be captured in a CUDA graph ({first}): it waits for the "
                "GPU (.item(), a copy to the CPU, a shape that depends on the data); use a rung "
                "without capture") from None
        self._note(tuple(x.shape), graph)
        return _Captured(graph, static_in, static_out)

    def _note(self, shape: tuple, graph: torch.cuda.CUDAGraph) -> None:
        """Rewrite the memsets of a graph kept after capture, instantiate it, and say so."""
        self.notes["×".join(map(str, shape))] = (
            rewrite_then_instantiate(graph) if self.memset_kernels else
            f"captured as is (this torch, {torch.__version__}, cannot edit a captured graph)")
        self.applied["capture"] = "; ".join(f"input {k}: {v}" for k, v in self.notes.items())
