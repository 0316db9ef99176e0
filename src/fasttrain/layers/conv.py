"""Convolutions over few input channels (an RGB image, SD's 4 latent channels) as one GEMM.

With 3 or 4 channels a pixel's channels fill less than the 16 bytes NHWC tensor-core kernels
read at a time, and cuDNN runs an Ampere-era kernel at a few percent of the GPU: SD's VAE input
convolution (3 → 128 channels, 3 × 3, 512 px, batch 8) took 0.65 ms, and its eager bias add
another 0.75 ms (encode-probe-sd-20261122-0535, conv-micro-sd-20261122-0150); padded to 8
channels cuDNN still chose that kernel (0.60 ms, encode-probe-sd-20261122-0549). Its work is
small: every output pixel is a dot product of 27 input values with 128 filters. ``GemmConv2d``
gathers those values (zero-padded to a multiple of 8 columns) into a (pixels × 32) matrix and
multiplies it by the (32 × out channels) filters with the bias in the GEMM's epilogue: the
output comes out channels-last, already with its bias, in one pass over its memory.

Numerics: the same products summed in fp32 (in another order); padded columns are exact zeros.
Parameters, their shapes and the state dict are the Conv2d's own.

With ``kernels=conv`` a frozen one (its weights need no gradient: SD's VAE input convolution)
runs as one Triton pass instead, which gathers each output tile's input values in place and
writes the output once (``kernels/narrow_conv.py``); it is forward-only, so a convolution whose
weights train, or a call whose input needs a gradient, keeps the gather + GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath

ALIGN = 8  # bf16/fp16 columns in 16 bytes


class GemmConv2d(FusedPath, nn.Conv2d):
    """``nn.Conv2d`` computed as gather + one GEMM; made from a Conv2d by ``as_gemm``. The
    output is channels-last whatever the input's layout. ``use_fused`` (``kernels=conv``) runs
    a frozen one as one Triton pass."""

    fused_kind, fused_triton = "conv", True
    fused = False  # as_gemm swaps the class of a built Conv2d: no __init__ of ours runs

    def trains(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on and not self.trains()
        what = describe(self)
        if self.trains():
            return [f"{what} convolution kept as a gather + GEMM (its weights train; the "
                    "Triton pass is forward-only)"]
        return [f"{what} convolution in one Triton pass (frozen, forward only)"]

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        if input.dim() == 3:  # unbatched (C, H, W), as nn.Conv2d takes it
            return self._conv_forward(input[None], weight, bias)[0]
        if self.fused and not (torch.is_grad_enabled() and (input.requires_grad or self.trains())):
            return self._triton(input, weight, bias)
        N, C, H, W = input.shape
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        Ho, Wo = H + 2 * ph - kh + 1, W + 2 * pw - kw + 1
        x = F.pad(input, (pw, pw, ph, ph))
        # column (i·kw + j)·C + c holds input channel c at offset (i, j): the weight's
        # (out, kh, kw, in) order
        cols = torch.cat([x[:, :, i:i + Ho, j:j + Wo] for i in range(kh) for j in range(kw)], 1)
        K = C * kh * kw
        extra = -K % ALIGN
        cols = F.pad(cols.permute(0, 2, 3, 1).reshape(N * Ho * Wo, K), (0, extra))
        w = F.pad(weight.permute(0, 2, 3, 1).reshape(self.out_channels, K), (0, extra))
        out = cols @ w.t() if bias is None else torch.addmm(bias, cols, w.t())
        return out.view(N, Ho, Wo, self.out_channels).permute(0, 3, 1, 2)

    def _triton(self, input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        from ..kernels.narrow_conv import narrow_conv2d

        kind = input.device.type
        if torch.is_autocast_enabled(kind):  # as autocast casts a convolution's arguments
            dtype = torch.get_autocast_dtype(kind)
            input, weight = input.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return narrow_conv2d(input, weight, bias, self.padding)


def describe(conv: nn.Conv2d) -> str:
    """"3 → 128 channels, 3 × 3"."""
    kh, kw = conv.kernel_size
    return f"{conv.in_channels} → {conv.out_channels} channels, {kh} × {kw}"


def fits_gemm(conv: nn.Module) -> bool:
    """A plain Conv2d (ungrouped, stride 1, no dilation, zero or no padding, at most 3 × 3)
    over fewer than 8 input channels."""
    return (type(conv) is nn.Conv2d and conv.in_channels < ALIGN and conv.groups == 1
            and conv.stride == (1, 1) and conv.dilation == (1, 1)
            and isinstance(conv.padding, tuple) and conv.padding_mode == "zeros"
            and max(conv.kernel_size) <= 3)


def frozen_narrow(conv: nn.Module) -> bool:
    """A convolution ``fits_gemm`` takes whose parameters need no gradient: what
    ``kernels=conv`` runs as one Triton pass."""
    return fits_gemm(conv) and not any(p.requires_grad for p in conv.parameters())


def as_gemm(conv: nn.Conv2d) -> str:
    """Turn ``conv`` into a GemmConv2d in place (same parameters and state dict); returns its
    shape ("3 → 128 channels, 3 × 3")."""
    conv.__class__ = GemmConv2d
    return describe(conv)


CONV_NETWORK = 2
"""Convolutions (other than a patch embedding, kernel = stride) from which a model counts as a
convolution network: channels-last is offered to it (the ladder's rung, ``fasttrain.Step``'s
default). A ViT's one patch convolution does not count."""


def conv_network(model: nn.Module) -> bool:
    """Whether ``model`` is a convolution network (``CONV_NETWORK``)."""
    return sum(isinstance(m, nn.Conv2d) and m.kernel_size != m.stride
               for m in model.modules()) >= CONV_NETWORK
