"""Graph memsets as kernels: the captured step's small memset nodes become kernel nodes.

When it helps: a graphed step whose cuBLAS and cuDNN calls zero a few bytes of workspace before
their kernels (SD: 265 memset nodes a step). A kernel node that waits on a memset node starts a
few microseconds after it; after a kernel node, well under one. Numerics: none (the same bytes
are stored before the same kernels). Requirements: cuda_graphs, a torch whose CUDAGraph keeps
its graph for editing (``keep_graph``). The rewrite itself lives in run/graph_memsets.py and
runs at capture; this card checks and records, and the capture adds what it rewrote.
"""
from __future__ import annotations

import inspect

import torch

from .base import Phase, Technique, TrainState


def keeps_graph() -> bool:
    """Whether this torch's CUDAGraph can keep its graph after capture for editing."""
    return "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters


def _unmet(recipe, device_type: str) -> str | None:
    if not keeps_graph():
        return (f"graph_memset_kernels needs a torch whose CUDAGraph takes keep_graph "
                f"(this is {torch.__version__})")
    return None


def apply(state: TrainState) -> str:
    if not state.cuda:
        raise ValueError("graph_memset_kernels needs a CUDA device")
    return "small memset nodes of the captured step rewritten as kernel nodes"


TECHNIQUE = Technique(
    name="graph_memset_kernels", phase=Phase.GRAPH_MEMSETS,
    summary="a captured step's small memsets as kernel nodes", changes_numerics=False,
    apply=apply, requires=("cuda",), active=lambda r: r.graph_memset_kernels, unmet=_unmet,
    example={"cuda_graphs": True, "graph_memset_kernels": True})
