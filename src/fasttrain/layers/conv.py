"""Convolutions with few input channels, padded with zero channels for NHWC tensor cores.

An image (3 channels) or SD's latent (4) gives every pixel 6 or 8 bytes of bf16 channels. The
NHWC tensor-core kernels of cuDNN on Hopper read a pixel's channels in 16-byte pieces, so for
those convolutions cuDNN falls back to an older kernel (SD's VAE input convolution at 512 px ran
an Ampere ``cutlass ... s16816fprop`` kernel, 0.65 ms of the frozen encoder's 20 ms:
encode-probe-sd-20261122-0535). ``ChannelPaddedConv2d`` appends zero channels to the input and
zero input channels to the weight up to a multiple of 8 before the convolution: every product
with a padded channel is an exact zero, so the result is the same, and the parameters (and
their gradients) keep their own shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MULTIPLE = 8  # bf16/fp16 channels in 16 bytes


class ChannelPaddedConv2d(nn.Conv2d):
    """``nn.Conv2d`` that pads its input channels with zeros up to a multiple of 8 (its weight
    with zero input channels) before convolving; made from a Conv2d by ``pad_channels``."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        extra = -self.in_channels % MULTIPLE
        # F.pad keeps channels-last tensors channels-last; its spec runs from the last dim
        return super()._conv_forward(F.pad(input, (0, 0, 0, 0, 0, extra)),
                                     F.pad(weight, (0, 0, 0, 0, 0, extra)), bias)


def needs_padding(conv: nn.Module) -> bool:
    """A plain (ungrouped) Conv2d, stride 1 and at most 3 × 3, whose input channels are not a
    multiple of 8 (a patch embedding's large kernel would multiply its reduction instead)."""
    return (type(conv) is nn.Conv2d and conv.groups == 1 and conv.in_channels % MULTIPLE != 0
            and conv.stride == (1, 1) and conv.kernel_size[0] * conv.kernel_size[1] <= 9)


def pad_channels(conv: nn.Conv2d) -> str:
    """Turn ``conv`` into a ChannelPaddedConv2d in place (same parameters and state dict);
    returns "3 → 8"."""
    conv.__class__ = ChannelPaddedConv2d
    return f"{conv.in_channels} → {conv.in_channels + (-conv.in_channels % MULTIPLE)}"
