"""Zero-padded input channels (layers/conv.py): the same output and gradients as the plain
convolution, in NCHW and NHWC, and only the convolutions it is meant for."""
import pytest
import torch
from torch import nn

from fasttrain.layers.conv import ChannelPaddedConv2d, needs_padding, pad_channels


@pytest.mark.parametrize("cin", [3, 4, 11])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=str)
def test_padded_channels_give_the_plain_convolution(cin, fmt):
    torch.manual_seed(0)
    plain = nn.Conv2d(cin, 16, 3, padding=1).to(memory_format=fmt)
    padded = nn.Conv2d(cin, 16, 3, padding=1).to(memory_format=fmt)
    padded.load_state_dict(plain.state_dict())
    assert needs_padding(padded)
    assert pad_channels(padded) == f"{cin} → {cin + (-cin % 8)}"
    assert isinstance(padded, ChannelPaddedConv2d) and not needs_padding(padded)
    assert padded.weight.shape == plain.weight.shape
    assert list(padded.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, cin, 9, 7).contiguous(memory_format=fmt)
    outs = []
    for conv in (plain, padded):
        xi = x.clone().requires_grad_()
        y = conv(xi)
        y.square().sum().backward()
        outs.append((y, xi.grad, conv.weight.grad, conv.bias.grad))
    assert outs[1][0].is_contiguous(memory_format=fmt)
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_small_ungrouped_stride_one_convolutions_with_odd_channels_are_padded():
    assert not needs_padding(nn.Conv2d(8, 16, 3))  # already a multiple of 8
    assert not needs_padding(nn.Conv2d(3, 768, 16, stride=16))  # a patch embedding
    assert not needs_padding(nn.Conv2d(3, 12, 5))  # a larger kernel: more reduction
    assert not needs_padding(nn.Conv2d(6, 6, 3, groups=3))
    assert not needs_padding(nn.Linear(3, 4))
    assert needs_padding(nn.Conv2d(3, 128, 3, padding=1)) and needs_padding(nn.Conv2d(4, 8, 1))
