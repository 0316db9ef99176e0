"""The Stable Diffusion v1 denoiser: a text-conditioned UNet with the shapes of diffusers'
``UNet2DConditionModel`` at the SD v1 config (859,520,964 parameters at ``UNetConfig()``).

Four stages of (320, 640, 1280, 1280) channels with two ResNet blocks each; the first three
stages put a spatial transformer (self-attention, cross-attention to the text, GEGLU
feed-forward) after every ResNet block and end with a stride-2 conv. The mid block is
ResNet → transformer → ResNet; the up path mirrors the down path with three ResNet blocks per
stage, each fed one skip connection. The blocks (ResNet, resamplers, spatial transformer) are in
``layers/unet.py``; all attention goes through ``layers.attention``. Module names follow
diffusers, so its UNet state dict loads one to one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import stackable, stacked
from ..layers.norm import GroupNorm
from ..layers.sd_transformer import Heads2
from ..layers.unet import (NORM_GROUPS, Downsample, ResnetBlock, SpatialTransformer, Upsample,
                           cat_channels)
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


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


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
