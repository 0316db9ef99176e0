"""``kernels/gemm_epilogue.py`` on a GPU (marker ``gpu``; skipped without one): cuBLASLt's
epilogue computes the tanh GELU, so the output matches ``F.gelu(…, approximate="tanh")`` of the
same linear within the dtype's rounding, and differs from the erf GELU by up to its ~5e-4."""
import pytest
import torch
import torch.nn.functional as F

from fasttrain.kernels.gemm_epilogue import linear_gelu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-2),
                                        (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("rows", [1, 197, 1000])
def test_the_epilogue_is_the_tanh_gelu_of_the_linear(dtype, tol, rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 256, device="cuda")
    w, b = torch.randn(512, 256, device="cuda") / 16, torch.randn(512, device="cuda")
    y = linear_gelu(x.to(dtype), w.to(dtype), b.to(dtype)).float()
    z = F.linear(x.to(dtype).float(), w.to(dtype).float(), b.to(dtype).float())
    torch.testing.assert_close(y, F.gelu(z, approximate="tanh"), rtol=tol, atol=tol)
    if dtype == torch.float32:  # the approximation is visible in fp32: it is not the erf GELU
        assert (y - F.gelu(z)).abs().max() > 1e-4
