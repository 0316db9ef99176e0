"""The building blocks of Stable Diffusion v1's UNet and VAE, with the module names of diffusers
(``ResnetBlock2D``, ``Downsample2D``, ``Upsample2D``, ``Transformer2DModel``), so a diffusers
state dict loads one to one and diffusers' own modules convert into these in place
(``converters/diffusers_sd.py``). ``workloads/sd_unet.py`` and ``workloads/sd_encoders.py`` build
fasttrain's UNet and VAE encoder from them."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .norm import GroupNorm
from .sd_transformer import Heads2, TransformerBlock

NORM_GROUPS = 32


def _format(x: torch.Tensor) -> torch.memory_format:
    """x's memory format: channels-last where x is dense NHWC and not NCHW-contiguous, else
    contiguous (NCHW)."""
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if nhwc else torch.contiguous_format


def norm2_bias_from(time_embedding: bool) -> str:
    """What a ResNet block's norm2 adds in its kernels (its fused path says so)."""
    return "the convolution's bias" + (" and time embedding" if time_embedding else "")


class ResnetBlock(nn.Module):
    """diffusers ``ResnetBlock2D``: GN-SiLU-conv, + time embedding, GN-SiLU-conv, + shortcut.

    ``temb=None`` drops the time projection (the VAE's blocks). With the GroupNorm kernels
    (``kernels=groupnorm``) conv1 runs without its bias: norm2's kernels add it, with the time
    embedding, as they read conv1's output, so ``conv1 + bias + temb`` is never written. In the
    frozen VAE the block's input is also made one buffer under torch.compile, which norm1 and the
    shortcut both read (otherwise Inductor writes a copy for norm1's kernels and the sum after
    recomputes the input from its own inputs)."""

    def __init__(self, cin: int, cout: int, temb: int | None, eps: float):
        super().__init__()
        self.norm1 = GroupNorm(NORM_GROUPS, cin, eps=eps, silu=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, cout) if temb else None
        self.norm2 = GroupNorm(NORM_GROUPS, cout, eps=eps, silu=True,
                               x_bias_from=norm2_bias_from(bool(temb)))
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def _bias_into_norm2(self) -> bool:
        """Whether conv1 runs without its bias and norm2's kernels add it: on the fused path, for
        a plain ``nn.Conv2d`` (a convolution another library wrapped runs whole)."""
        return (self.norm2.takes_bias() and type(self.conv1) is nn.Conv2d
                and self.conv1.bias is not None)

    def fp32_params(self) -> list[nn.Parameter]:
        """What the fused path reads outside autocast's casts: conv1's bias, added in fp32 in
        norm2's kernels (bf16 master weights leave it fp32, techniques/optimizer.py)."""
        return [self.conv1.bias] if self._bias_into_norm2() else []

    def time_projection(self, temb: torch.Tensor) -> torch.Tensor:
        """This block's share of the time embedding, (B, cout)."""
        return self.time_emb_proj(F.silu(temb))

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None,
                emb: torch.Tensor | None = None) -> torch.Tensor:
        """``emb``: this block's time projection already computed (the UNet computes all of
        them in one GEMM), else it is computed here from ``temb``."""
        x = self.norm1.shared_input(x)  # norm1 and the shortcut both read x
        h = self.norm1(x)
        if emb is None and self.time_emb_proj is not None:
            emb = self.time_projection(temb)
        if self._bias_into_norm2():
            shift = self.conv1.bias if emb is None else self.conv1.bias + emb
            h = self.norm2(self.conv1._conv_forward(h, self.conv1.weight, None), x_bias=shift)
        else:
            h = self.conv1(h)
            h = self.norm2(h if emb is None else h + emb[:, :, None, None])
        h = self.conv2(h)
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class Downsample(nn.Module):
    """Stride-2 3×3 conv; ``asymmetric`` pads (0, 1, 0, 1) first instead of 1 all round (VAE)."""

    def __init__(self, ch: int, asymmetric: bool = False):
        super().__init__()
        self.asymmetric = asymmetric
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0 if asymmetric else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)) if self.asymmetric else x)


class _Nearest2x(torch.autograd.Function):
    """``F.interpolate(x, scale_factor=2, mode="nearest")`` whose backward sums each 2 × 2
    block of the gradient as a reduction over a view. Autograd's own backward scatters the
    gradient with an accumulating ``index_put`` into zeros, which Inductor compiles to atomic
    adds (0.33 ms of SD's step for 3 upsamplers, a tenth of it at the copy ceiling:
    profile-sd-base-20261122-081837). The sum is laid out as x is: a reduction's result is
    NCHW, and the channels-last convolutions before an upsampler copied their NCHW gradient to
    NHWC inside ``convolution_backward`` (three copies of 8 × 640 × 32 × 32 and three of
    8 × 1,280 × 16 × 16 a step, 0.18 ms: copy-probe-sd-20261122-1146)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.channels_last = _format(x) == torch.channels_last
        return F.interpolate(x, scale_factor=2.0, mode="nearest")

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        B, C, H, W = g.shape[0], g.shape[1], g.shape[2] // 2, g.shape[3] // 2
        if ctx.channels_last:  # (B, 2H, 2W, C) → (B, H, 2, W, 2, C): the sum comes out NHWC
            g = g.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
            g = g.reshape(B, H, 2, W, 2, C)
            return g.sum((2, 4)).permute(0, 3, 1, 2)
        return g.unflatten(3, (W, 2)).unflatten(2, (H, 2)).sum((3, 5))


class _CatChannels(torch.autograd.Function):
    """``torch.cat([a, b], dim=1)`` whose backward hands each input a dense gradient in its own
    memory format. Autograd's gives channel slices of the concatenation's gradient; a slice of
    an NHWC tensor is not dense, and every consumer copied it on its own: the ResNet's
    convolutions before the concatenation inside ``convolution_backward`` (its
    ``contiguous()``), the blocks across a compiled region's edge in AOTAutograd's check of
    their incoming gradients (0.39 ms of copies a step in all: copy-probe-sd-20261122-1146).
    Here the slices are made dense where the gradient is computed, once, which Inductor can
    fold into the kernel that computes them."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.split, ctx.formats = a.shape[1], (_format(a), _format(b))
        return torch.cat([a, b], dim=1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, (fa, fb) = ctx.split, ctx.formats
        return g[:, :n].contiguous(memory_format=fa), g[:, n:].contiguous(memory_format=fb)


def cat_channels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], dim=1)`` of two (B, C, H, W) maps (the UNet's skip connections):
    the same values both ways, each input's gradient dense in its own memory format."""
    return _CatChannels.apply(a, b)


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour 2× upsampling of (B, C, H, W), in x's memory format; the same values
    as ``F.interpolate(x, scale_factor=2.0, mode="nearest")`` both ways."""
    return _Nearest2x.apply(x)


class Upsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(upsample_nearest2x(x))


class SpatialTransformer(nn.Module):
    """diffusers ``Transformer2DModel`` (SD v1): GroupNorm, 1×1 conv in, one block, 1×1 conv out."""

    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.norm = GroupNorm(NORM_GROUPS, dim, eps=1e-6)
        self.proj_in = nn.Conv2d(dim, dim, 1)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(dim, heads, context)])
        self.proj_out = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                kvs: Sequence[Heads2] | None = None) -> torch.Tensor:
        """``kvs``: per transformer block, the text's keys and values already projected."""
        B, C, H, W = x.shape
        h = self.proj_in(self.norm(x)).permute(0, 2, 3, 1).reshape(B, H * W, C)
        for i, blk in enumerate(self.transformer_blocks):
            h = self.run_block(blk, h, context, None if kvs is None else kvs[i])
        h = h.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous(memory_format=_format(x))
        return x + self.proj_out(h)

    def run_block(self, block: nn.Module, h: torch.Tensor, context: torch.Tensor,
                  kv: Heads2 | None) -> torch.Tensor:
        """One transformer block on the tokens (a converted diffusers block takes diffusers'
        call: ``converters/diffusers_sd.py``)."""
        return block(h, context, kv)
