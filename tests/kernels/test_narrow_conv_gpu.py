"""The narrow-convolution kernel compiled on CUDA (marker ``gpu``; skipped without a GPU). A
sibling of test_narrow_conv.py, whose kernels run in Triton's interpreter and which is
skipped on a GPU (tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from tests.gpu_helpers import kernels_keep_the_losses


@pytest.mark.gpu
def test_narrow_conv_kernel_on_cuda_matches_cudnn_eager_and_compiled():
    """SD's VAE input convolution (3 → 128, 3 × 3, padding 1) and a masked case (4 → 20
    channels, odd sides, 1 × 3, tail tiles), bf16 and fp32, channels-last and NCHW inputs,
    eagerly and compiled (no graph break): within a rounding of cuDNN's output."""
    from fasttrain.kernels.narrow_conv import narrow_conv2d

    torch.manual_seed(0)
    for (n, c, h, w, o, k, pad) in [(2, 3, 96, 80, 128, (3, 3), (1, 1)),
                                    (3, 4, 17, 29, 20, (1, 3), (0, 1))]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
            weight = torch.randn(o, c, *k, device="cuda", dtype=dtype) / 3
            bias = torch.randn(o, device="cuda", dtype=dtype)
            want = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(),
                                              padding=pad)
            tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else \
                dict(rtol=1e-5, atol=1e-5)
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: narrow_conv2d(x, weight, bias, pad) * 2,
                                     fullgraph=True)
            for fmt in (torch.channels_last, torch.contiguous_format):
                xf = x.contiguous(memory_format=fmt)
                got = narrow_conv2d(xf, weight, bias, pad)
                assert got.is_contiguous(memory_format=torch.channels_last)
                torch.testing.assert_close(got.double(), want, **tol)
                torch.testing.assert_close(compiled(xf).double(), 2 * want, **tol)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_sd_narrow_conv_kernel_in_the_graphed_training_loop_keeps_the_losses():
    kernels_keep_the_losses("sd", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                          compile="regional", channels_last=True,
                                          cuda_graphs=True, kernels="groupnorm"),
                             ("groupnorm,conv",), "convolution in one Triton pass (frozen")

