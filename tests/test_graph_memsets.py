"""The captured step's memset rewrite where no GPU is needed: how it fails and what the graphed
step does then. Its GPU side (bytes stored, losses kept) is in test_gpu.py."""
import ctypes

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run import graph_memsets
from fasttrain.run.graphs import GraphedStep
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


class _Graph:
    """What GraphedStep and rewrite call on a torch.cuda.CUDAGraph."""

    def __init__(self):
        self.instantiated = 0

    def raw_cuda_graph(self) -> int:
        return 1234

    def instantiate(self) -> None:
        self.instantiated += 1


def _no_driver(monkeypatch):
    def refuse(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(graph_memsets, "_lib", None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)


def test_rewrite_without_a_driver_names_it(monkeypatch):
    _no_driver(monkeypatch)
    with pytest.raises(graph_memsets.GraphRewriteError, match="libcuda.so.1 did not load"):
        graph_memsets.rewrite(_Graph())


def test_a_failed_rewrite_still_instantiates_and_says_why(monkeypatch):
    _no_driver(monkeypatch)
    notes = []
    step = GraphedStep.__new__(GraphedStep)  # its __init__ makes a CUDA stream
    step.report, step.graph = notes.append, _Graph()
    graph = step.graph
    step._rewrite()
    assert graph.instantiated == 1
    note, = notes
    assert note.startswith("rewrite stopped (the CUDA driver library libcuda.so.1 did not load")
    assert note.endswith("; the rest of the graph as captured")


def test_driver_errors_name_the_call(monkeypatch):
    class Lib:
        def cuGraphGetNodes(self, *args):
            return 999  # CUDA_ERROR_UNKNOWN

    monkeypatch.setattr(graph_memsets, "_lib", Lib())
    with pytest.raises(graph_memsets.GraphRewriteError,
                       match="cuGraphGetNodes failed with CUresult 999"):
        graph_memsets.memsets(_Graph())


def test_memset_kernels_need_cuda_and_graphs():
    with pytest.raises(FasttrainError, match="set cuda_graphs=true"):
        Recipe(graph_memset_kernels=True)
    rec = Recipe(precision="bf16-mixed", cuda_graphs=True, graph_memset_kernels=True)
    with pytest.raises(FasttrainError, match="graph_memset_kernels needs CUDA"):
        train(load_workload("vit", "tiny"), rec, steps=1, warmup=0, device="cpu")
