"""The forward replayed from CUDA graphs that fasttrain captures itself, memsets as kernels.

``torch.compile(mode="reduce-overhead")`` records its CUDA graphs through cudagraph trees, which
do host work at every call (checking the inputs and the graphs' state) before they replay.
:class:`CapturedForward` records the forward (compiled without graphs, or eager) with
``torch.cuda.CUDAGraph``, one graph per input shape and dtype, and a call is a copy into the
graph's input, a replay and a copy of its output. Before instantiating a graph it rewrites the
graph's small memset nodes as kernel nodes (``run/graph_memsets.py``): cuBLAS and cuDNN zero a
few bytes of workspace before many of their GEMMs, and a kernel that waits on a memset node
starts about 3 µs after the kernel before it, one that waits on a kernel about 0.4 µs after it.
Numerics: none (the same kernels on the same bytes).

- The forward takes one tensor and returns one tensor; the output is a copy, so it stays valid
  after the next call, as an uncaptured forward's does.
- Capture and replay run on the input's GPU and under ``torch.inference_mode``.
- The first call at a new shape runs the forward ``warmup`` times on a side stream (compilation
  and autotuning happen there, outside the capture) and then captures it. Every shape keeps its
  graph and the graph's memory: serve a few fixed batch sizes (pad the last batch).
- One caller at a time: the graphs' input and output tensors are shared, so two threads or two
  streams calling at once would mix their batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import FasttrainError
from ..run.graph_memsets import rewrite_then_instantiate
from ..run.graphs import record
from ..techniques.graph_memsets import keeps_graph

Forward = Callable[[torch.Tensor], torch.Tensor]
Key = tuple[tuple[int, ...], torch.dtype, torch.device]


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
        self.forward, self.applied, self.warmup = forward, applied, warmup
        self.memset_kernels = memset_kernels and keeps_graph()
        self.as_is = ("captured as is" if not memset_kernels else f"captured as is (this torch, "
                      f"{torch.__version__}, cannot edit a captured graph)")
        self.graphs: dict[Key, _Captured] = {}
        self.notes: dict[str, str] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
            raise FasttrainError(f"a captured forward takes one tensor on a CUDA GPU, not {where}")
        key = (tuple(x.shape), x.dtype, x.device)
        with torch.cuda.device(x.device), torch.inference_mode():
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
        graph, static_out = record(
            lambda: self.forward(static_in), self.memset_kernels,
            "the forward could not be captured in a CUDA graph ({first}): it waits for the GPU "
            "(.item(), a copy to the CPU, a shape that depends on the data); use a rung "
            "without capture", stream=side)
        if not isinstance(static_out, torch.Tensor):
            raise FasttrainError(f"a captured forward returns one tensor; this one returned "
                                 f"{type(static_out).__name__}: use a rung without capture")
        self._instantiate(x, graph)
        return _Captured(graph, static_in, static_out)

    def _instantiate(self, x: torch.Tensor, graph: torch.cuda.CUDAGraph) -> None:
        """Rewrite the memsets of a graph kept after capture, instantiate it, and say so."""
        name = f"{'×'.join(map(str, x.shape))} {str(x.dtype).removeprefix('torch.')}" + (
            f" on {x.device}" if x.device.index else "")
        self.notes[name] = rewrite_then_instantiate(graph) if self.memset_kernels else self.as_is
        self.applied["capture"] = "; ".join(f"input {k}: {v}" for k, v in self.notes.items())
