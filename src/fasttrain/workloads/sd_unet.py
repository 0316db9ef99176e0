"""The Stable Diffusion v1 denoiser: a text-conditioned UNet with the shapes of diffusers'
``UNet2DConditionModel`` at the SD v1 config (859,520,964 parameters at ``UNetConfig()``).

Four stages of (320, 640, 1280, 1280) channels with two ResNet blocks each; the first three
stages put a spatial transformer (self-attention, cross-attention to the text, GEGLU
feed-forward) after every ResNet block and end with a stride-2 conv. The mid block is
ResNet → transformer → ResNet; the up path mirrors the down path with three ResNet blocks per
stage, each fed one skip connection. The transformer blocks inside the spatial transformers
are in ``sd_transformer``; all attention goes through ``layers.attention``. Module names follow
diffusers, so its UNet state dict loads one to one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import stackable, stacked
from ..layers.norm import GroupNorm
from .sd_transformer import Heads2, TransformerBlock

NORM_GROUPS = 32
Conditioning = Optional[tuple[Optional[list[torch.Tensor]], Optional[list[list[Heads2]]]]]
"""What the UNet hands a block besides temb and the text: its ResNets' time projections, and
per spatial transformer, per transformer block, the text's keys and values for attn2 (either
None where the block computes them itself; None for both)."""


@dataclass(frozen=True)
class UNetConfig:
    channels: tuple[int, ...] = (320, 640, 1280, 1280)
    cross_attn: tuple[bool, ...] = (True, True, True, False)  # per down stage; up mirrors it
    layers: int = 2  # ResNet blocks per down stage (up stages have one more)
    heads: int = 8  # diffusers' ``attention_head_dim=8`` is really the head count
    context: int = 768  # width of the text embedding (cross_attention_dim)
    latent: int = 4  # latent channels in and out
    eps: float = 1e-5


def timestep_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """diffusers ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)``: [cos, sin]."""
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    args = timesteps[:, None].float() * torch.exp(-math.log(10000.0) * exponent)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _format(x: torch.Tensor) -> torch.memory_format:
    """x's memory format: channels-last where x is dense NHWC and not NCHW-contiguous, else
    contiguous (NCHW)."""
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if nhwc else torch.contiguous_format


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


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
        what = "the convolution's bias" + (" and time embedding" if temb else "")
        self.norm2 = GroupNorm(NORM_GROUPS, cout, eps=eps, silu=True, x_bias_from=what)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def _bias_into_norm2(self) -> bool:
        """Whether conv1 runs without its bias and norm2's kernels add it."""
        return self.norm2.takes_bias() and self.conv1.bias is not None

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
            h = blk(h, context, None if kvs is None else kvs[i])
        h = h.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous(memory_format=_format(x))
        return x + self.proj_out(h)


def _transformers(cfg: UNetConfig, ch: int, n: int, attn: bool) -> nn.ModuleList | None:
    if not attn:
        return None
    return nn.ModuleList(SpatialTransformer(ch, cfg.heads, cfg.context) for _ in range(n))


class DownBlock(nn.Module):
    """``CrossAttnDownBlock2D`` (``attn``) or ``DownBlock2D``; returns (x, skip tensors)."""

    def __init__(self, cin: int, cout: int, cfg: UNetConfig, temb: int, attn: bool, down: bool):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, temb, cfg.eps)
                                     for i in range(cfg.layers))
        self.attentions = _transformers(cfg, cout, cfg.layers, attn)
        self.downsamplers = nn.ModuleList([Downsample(cout)]) if down else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor,
                cond: Conditioning = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        embs, kvs = cond or (None, None)
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb, None if embs is None else embs[i])
            if self.attentions is not None:
                x = self.attentions[i](x, context, None if kvs is None else kvs[i])
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nn.Module):
    """``CrossAttnUpBlock2D`` (``attn``) or ``UpBlock2D``: layers+1 ResNets on [x, skip]."""

    def __init__(self, cin: int, prev: int, cout: int, cfg: UNetConfig, temb: int, attn: bool,
                 up: bool):
        super().__init__()
        n = cfg.layers + 1
        self.resnets = nn.ModuleList(
            ResnetBlock((prev if i == 0 else cout) + (cin if i == n - 1 else cout), cout, temb,
                        cfg.eps) for i in range(n))
        self.attentions = _transformers(cfg, cout, n, attn)
        self.upsamplers = nn.ModuleList([Upsample(cout)]) if up else None

    def forward(self, x: torch.Tensor, skips: tuple[torch.Tensor, ...], temb: torch.Tensor,
                context: torch.Tensor, cond: Conditioning = None) -> torch.Tensor:
        embs, kvs = cond or (None, None)
        for i, resnet in enumerate(self.resnets):  # skips are consumed last-first
            x = resnet(cat_channels(x, skips[-1 - i]), temb,
                       None if embs is None else embs[i])
            if self.attentions is not None:
                x = self.attentions[i](x, context, None if kvs is None else kvs[i])
        return x if self.upsamplers is None else self.upsamplers[0](x)


class MidBlock(nn.Module):
    """``UNetMidBlock2DCrossAttn``: ResNet → transformer → ResNet."""

    def __init__(self, ch: int, cfg: UNetConfig, temb: int):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(ch, ch, temb, cfg.eps) for _ in range(2))
        self.attentions = _transformers(cfg, ch, 1, True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor,
                cond: Conditioning = None) -> torch.Tensor:
        embs, kvs = cond or (None, None)
        x = self.resnets[0](x, temb, None if embs is None else embs[0])
        x = self.attentions[0](x, context, None if kvs is None else kvs[0])
        return self.resnets[1](x, temb, None if embs is None else embs[1])


class UNet(nn.Module):
    """The denoiser. The time embedding's projections of every ResNet block (22 at SD v1) run as
    one GEMM, and so do the text's key and value projections of every cross-attention (16 × 2),
    where those layers are plain linears (``stacked``; float8 layers keep their own matmuls,
    and FSDP2's sharded ones are left to the blocks, whose forward gathers them):
    one GEMM of (8 × 1,280) by (20,160 × 1,280), where each of the 22 small ones and their two
    backward GEMMs took 5-20 µs, most of it latency (profile-sd-base-20261122-081837). Each
    block takes its share (``Conditioning``); the weights stay in their layers.
    ``stacked = False`` leaves the projections to the blocks."""

    stacked = True

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        ch, n = cfg.channels, len(cfg.channels)
        temb = 4 * ch[0]
        self.conv_in = nn.Conv2d(cfg.latent, ch[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(ch[0], temb)
        self.down_blocks = nn.ModuleList(
            DownBlock(ch[max(i - 1, 0)], ch[i], cfg, temb, cfg.cross_attn[i], i < n - 1)
            for i in range(n))
        self.mid_block = MidBlock(ch[-1], cfg, temb)
        rev, rattn = ch[::-1], cfg.cross_attn[::-1]
        self.up_blocks = nn.ModuleList(
            UpBlock(rev[min(i + 1, n - 1)], rev[max(i - 1, 0)], rev[i], cfg, temb, rattn[i],
                    i < n - 1) for i in range(n))
        self.conv_norm_out = GroupNorm(NORM_GROUPS, ch[0], eps=cfg.eps, silu=True)
        self.conv_out = nn.Conv2d(ch[0], cfg.latent, 3, padding=1)

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor,
                context: torch.Tensor) -> torch.Tensor:
        """Predicted noise for ``sample`` (B, 4, h, w) at ``timesteps`` (B,) given the text."""
        t = timestep_embedding(timesteps, self.cfg.channels[0]).to(sample.dtype)
        temb = self.time_embedding(t)
        cond = iter(self._conditioning(temb, context))
        x = self.conv_in(sample)
        skips = [x]
        for blk in self.down_blocks:
            x, res = blk(x, temb, context, next(cond))
            skips.extend(res)
        x = self.mid_block(x, temb, context, next(cond))
        for blk in self.up_blocks:
            n = len(blk.resnets)
            x = blk(x, tuple(skips[-n:]), temb, context, next(cond))
            skips = skips[:-n]
        return self.conv_out(self.conv_norm_out(x))

    def _conditioning(self, temb: torch.Tensor, context: torch.Tensor) -> list[Conditioning]:
        """Each block's ``Conditioning``, in the order the forward runs the blocks."""
        blocks = [*self.down_blocks, self.mid_block, *self.up_blocks]
        projs = [r.time_emb_proj for b in blocks for r in b.resnets]
        attns = [[[tb.attn2 for tb in st.transformer_blocks] for st in (b.attentions or ())]
                 for b in blocks]
        text = [lin for per in attns for st in per for a in st for lin in (a.to_k, a.to_v)]
        embs: list[list[torch.Tensor] | None] = [None] * len(blocks)
        kvs: list[list[list[Heads2]] | None] = [None] * len(blocks)
        if self.stacked and stackable(projs):
            flat = iter(stacked(projs, F.silu(temb)))
            embs = [[next(flat) for _ in b.resnets] for b in blocks]
        if self.stacked and stackable(text):
            flat = iter(stacked(text, context))
            kvs = [[[a.text_heads(next(flat), next(flat)) for a in st] for st in per]
                   for per in attns]
        return [(e, k) for e, k in zip(embs, kvs)]
