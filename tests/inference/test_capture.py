"""fasttrain's own CUDA graphs for a forward (inference/capture.py) and the capture it shares
with the training step (run/graphs.py ``record``): the refusals that need no GPU, a capture that
fails (a stand-in graph), the switch a torch without ``keep_graph`` turns off; on CUDA (marker
``gpu``), the captured outputs against the uncaptured forward's, one graph per shape, outputs
that outlive the next call, no small memset left, and a forward that syncs or returns a tuple."""
import contextlib

import pytest
import torch
from torch import nn

from fasttrain.errors import FasttrainError
from fasttrain.inference import capture
from fasttrain.inference.capture import CapturedForward
from fasttrain.run import graphs

CUDA = torch.cuda.is_available()


def test_an_input_on_the_cpu_is_refused():
    fwd = CapturedForward(nn.Linear(4, 4), {})
    with pytest.raises(FasttrainError, match="a captured forward takes one tensor on a CUDA "
                                             "GPU, not cpu"):
        fwd(torch.zeros(2, 4))
    with pytest.raises(FasttrainError, match="one tensor on a CUDA GPU, not list"):
        fwd([1.0])


def test_no_warm_up_is_refused():
    with pytest.raises(FasttrainError, match="at least one warm-up call, not 0"):
        CapturedForward(nn.Linear(4, 4), {}, warmup=0)


def test_a_torch_that_cannot_edit_graphs_captures_as_is(monkeypatch):
    monkeypatch.setattr(capture, "keeps_graph", lambda: False)
    fwd = CapturedForward(nn.Linear(4, 4), {})
    assert not fwd.memset_kernels and "cannot edit a captured graph" in fwd.as_is
    assert CapturedForward(nn.Linear(4, 4), {}, memset_kernels=False).as_is == "captured as is"


def test_a_capture_that_fails_is_one_line(monkeypatch):
    made = []

    class Graph:
        def __init__(self, keep_graph: bool = False):
            made.append(keep_graph)

    @contextlib.contextmanager
    def failing(graph, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        yield
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", failing)
    with pytest.raises(FasttrainError) as err:
        graphs.record(lambda: 1, True, "could not be captured ({first}); do this")
    assert str(err.value) == ("could not be captured (operation not permitted when stream is "
                              "capturing); do this")
    assert made == [True]
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    graph, out = graphs.record(lambda: 7, False, "unused {first}")
    assert isinstance(graph, Graph) and out == 7 and made == [True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_captured_forward_matches_and_keeps_its_outputs():
    from fasttrain.run.graph_memsets import memsets

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda().half()
    applied: dict = {}
    fwd = CapturedForward(model, applied)
    with torch.inference_mode():
        a, b = (torch.randn(32, 64, device="cuda", dtype=torch.half) for _ in range(2))
        out_a = fwd(a)
        out_b = fwd(b)  # replayed: out_a must survive it
        torch.testing.assert_close(out_a, model(a), rtol=0, atol=0)
        torch.testing.assert_close(out_b, model(b), rtol=0, atol=0)
        one = torch.randn(1, 64, device="cuda", dtype=torch.half)
        torch.testing.assert_close(fwd(one), model(one), rtol=0, atol=0)
    assert len(fwd.graphs) == 2
    assert "input 32×64 float16: " in applied["capture"] and "input 1×64 float16: " in \
        applied["capture"] and "stopped" not in applied["capture"]
    for entry in fwd.graphs.values():  # every small memset rewritten (if cuBLAS made any)
        assert all(size > 4096 for size in memsets(entry.graph))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_forward_that_syncs_or_returns_a_tuple_is_one_line():
    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.sum().item())

    with pytest.raises(FasttrainError, match="could not be captured in a CUDA graph"):
        CapturedForward(Syncs(), {}, warmup=1)(torch.ones(4, device="cuda"))

    class Pair(nn.Module):
        def forward(self, x):
            return x + 1, x - 1

    with pytest.raises(FasttrainError, match="returns one tensor; this one returned tuple"):
        CapturedForward(Pair(), {}, warmup=1)(torch.ones(4, device="cuda"))
