"""fasttrain's own CUDA graphs for a forward (inference/capture.py): the refusals that need no
GPU; on CUDA (marker ``gpu``), the captured outputs against the uncaptured forward's, one graph
per shape, outputs that outlive the next call, and the memsets rewritten."""
import pytest
import torch
from torch import nn

from fasttrain.errors import FasttrainError
from fasttrain.inference.capture import CapturedForward

CUDA = torch.cuda.is_available()


def test_an_input_on_the_cpu_is_refused():
    fwd = CapturedForward(nn.Linear(4, 4), {})
    with pytest.raises(FasttrainError, match="a captured forward runs on a CUDA GPU; its input "
                                             "is on cpu"):
        fwd(torch.zeros(2, 4))


def test_no_warm_up_is_refused():
    with pytest.raises(FasttrainError, match="at least one warm-up call, not 0"):
        CapturedForward(nn.Linear(4, 4), {}, warmup=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_captured_forward_matches_and_keeps_its_outputs():
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
    assert "input 32×64: " in applied["capture"] and "input 1×64: " in applied["capture"]
    assert "nodes were memsets, now kernels" in applied["capture"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_forward_that_syncs_is_one_line():
    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.sum().item())

    fwd = CapturedForward(Syncs(), {}, warmup=1)
    with pytest.raises(FasttrainError, match="could not be captured in a CUDA graph"):
        fwd(torch.ones(4, device="cuda"))
