"""The captured step's memset rewrite: where no GPU is needed, how it fails and what the graphed
step does then; on CUDA (marker ``gpu``, at the end), the bytes stored and the losses kept."""
import ctypes

import pytest
import torch

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


@pytest.mark.gpu
def test_rewritten_memsets_store_the_bytes_the_driver_would():
    """Driver memsets of each element size, 1-D and pitched 2-D, captured with a copy after
    them, once as they are and once rewritten as kernel nodes: the same bytes, which are the
    ones the memsets describe."""
    import ctypes

    from fasttrain.run.graph_memsets import _driver, memsets, rewrite

    lib = _driver()
    buf = torch.full((256,), 0xAA, dtype=torch.uint8, device="cuda")
    base = buf.data_ptr()
    want = torch.full((256,), 0xAA, dtype=torch.uint8)
    want[3:10] = 0x5C
    want[16:26] = torch.tensor([0xEF, 0xBE] * 5, dtype=torch.uint8)
    want[32:44] = torch.tensor([0x78, 0x56, 0x34, 0x12] * 3, dtype=torch.uint8)
    for row in range(4):
        want[64 + 16 * row: 69 + 16 * row] = 0x7E
    outs = []
    for edit in (False, True):
        buf.fill_(0xAA)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            u64 = ctypes.c_uint64
            assert lib.cuMemsetD8Async(u64(base + 3), ctypes.c_ubyte(0x5C), ctypes.c_size_t(7),
                                       s) == 0
            assert lib.cuMemsetD16Async(u64(base + 16), ctypes.c_ushort(0xBEEF),
                                        ctypes.c_size_t(5), s) == 0
            assert lib.cuMemsetD32Async(u64(base + 32), ctypes.c_uint(0x12345678),
                                        ctypes.c_size_t(3), s) == 0
            assert lib.cuMemsetD2D8Async(u64(base + 64), ctypes.c_size_t(16),
                                         ctypes.c_ubyte(0x7E), ctypes.c_size_t(5),
                                         ctypes.c_size_t(4), s) == 0
            out = buf.clone()
        assert len(memsets(graph)) == 4
        if edit:
            r = rewrite(graph)
            assert (r.rewritten, r.kept) == (4, 0) and memsets(graph) == []
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.cpu())
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


@pytest.mark.gpu
def test_library_memsets_rewritten_as_kernels_replay_bit_for_bit():
    """cuBLAS GEMMs, cuDNN attention and a convolution captured twice, once with their small
    memsets as kernel nodes: none of them is left, and the outputs are equal bit for bit."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fasttrain.run.graph_memsets import memsets, rewrite

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 320, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(320, 320, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    q = torch.randn(2, 8, 1024, 40, device="cuda", dtype=torch.bfloat16, generator=g)
    img = torch.randn(2, 64, 32, 32, device="cuda", dtype=torch.bfloat16,
                      generator=g).to(memory_format=torch.channels_last)
    cw = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16, generator=g)
          * 0.05).to(memory_format=torch.channels_last)

    def body():
        h = x
        for _ in range(8):
            h = torch.tanh(h @ w)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            a = F.scaled_dot_product_attention(q, q, q)
        return h, a, torch.tanh(F.conv2d(img, cw, padding=1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    outs = []
    for edit in (False, True):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = body()
        if edit:
            small = [b for b in memsets(graph) if b <= 4096]
            if not small:
                pytest.skip("this cuBLAS and cuDNN captured no small memsets")
            r = rewrite(graph)
            assert r.rewritten == len(small) and all(b > 4096 for b in memsets(graph))
        graph.instantiate()
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        outs.append([o.clone() for o in out])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_graph_memset_kernels_in_the_graphed_training_loop_keep_the_losses():
    wl = load_workload("vit", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  cuda_graphs=True, lr=1e-3)
    plain = train(wl, base, steps=4, warmup=2, device="cuda")
    ours = train(wl, base.replace(graph_memset_kernels=True), steps=4, warmup=2, device="cuda")
    line = ours.applied["graph_memset_kernels"]
    assert "memset nodes of the captured step rewritten as kernel nodes: " in line
    # the tiny ViT's GEMMs may capture no workspace memsets (torch 2.11's cuBLAS on an H200:
    # none among 158 nodes); the line says which, and the step runs either way
    assert ("were memsets, now kernels" in line or "no memsets among the graph's" in line)
    assert not ours.warnings
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=1e-3, atol=0)

