"""Convolutions over few channels as a gather + GEMM (layers/conv.py): the same output and
gradients as the plain convolution, from NCHW and NHWC inputs, channels-last out, and only the
convolutions it is meant for."""
import pytest
import torch
from torch import nn

from fasttrain.layers.conv import GemmConv2d, as_gemm, fits_gemm


def _pair(*args, **kw) -> tuple[nn.Conv2d, nn.Conv2d]:
    """A plain Conv2d and a GemmConv2d with the same parameters."""
    torch.manual_seed(0)
    plain, gemm = nn.Conv2d(*args, **kw), nn.Conv2d(*args, **kw)
    gemm.load_state_dict(plain.state_dict())
    assert fits_gemm(gemm)
    return plain, gemm


@pytest.mark.parametrize("cin, kernel, padding", [(3, 3, 1), (4, 3, 1), (1, 3, 0), (3, 1, 0),
                                                  (2, (1, 3), (0, 1))], ids=str)
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_gemm_convolution_gives_the_plain_convolution(cin, kernel, padding, fmt, bias):
    plain, gemm = (c.to(memory_format=fmt)
                   for c in _pair(cin, 16, kernel, padding=padding, bias=bias))
    assert as_gemm(gemm).startswith(f"{cin} → 16 channels")
    assert isinstance(gemm, GemmConv2d) and not fits_gemm(gemm)
    assert list(gemm.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, cin, 9, 7).contiguous(memory_format=fmt)
    outs = []
    for conv in (plain, gemm):
        xi = x.clone().requires_grad_()
        y = conv(xi)
        y.square().sum().backward()
        outs.append((y, xi.grad, *(p.grad for p in conv.parameters())))
    assert outs[1][0].is_contiguous(memory_format=torch.channels_last)
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemm_convolution_under_bf16_autocast():
    plain, gemm = _pair(3, 32, 3, padding=1)
    as_gemm(gemm)
    x = torch.randn(2, 3, 16, 16)
    with torch.autocast("cpu", torch.bfloat16):
        got, want = gemm(x), plain(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_only_small_ungrouped_stride_one_convolutions_over_few_channels_run_as_gemms():
    assert not fits_gemm(nn.Conv2d(8, 16, 3))  # enough channels for cuDNN's NHWC kernels
    assert not fits_gemm(nn.Conv2d(3, 768, 16, stride=16))  # a patch embedding
    assert not fits_gemm(nn.Conv2d(3, 12, 5))  # a larger kernel
    assert not fits_gemm(nn.Conv2d(3, 12, (1, 9)))
    assert not fits_gemm(nn.Conv2d(3, 12, 3, dilation=2))
    assert not fits_gemm(nn.Conv2d(3, 12, 3, padding="same"))
    assert not fits_gemm(nn.Conv2d(3, 12, 3, padding=1, padding_mode="reflect"))
    assert not fits_gemm(nn.Conv2d(6, 6, 3, groups=3))
    assert not fits_gemm(nn.Linear(3, 4))
    assert fits_gemm(nn.Conv2d(3, 128, 3, padding=1)) and fits_gemm(nn.Conv2d(4, 8, 1))


def test_gemm_convolution_of_an_unbatched_input():
    plain, gemm = _pair(3, 8, 3, padding=1)
    as_gemm(gemm)
    x = torch.randn(3, 6, 5)
    torch.testing.assert_close(gemm(x), plain(x), rtol=1e-5, atol=1e-5)
