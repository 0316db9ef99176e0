"""ViT-B/16 and ViT-L/16 image classification (the shapes of timm's vit_base_patch16_224).

Options from the ViT source (seeds/003): ``pool='avg'`` replaces the CLS token by a pooled
classifier (one token fewer, no token concat); ``batch_second=True`` keeps the residual stream
as (T, B, C).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import attention
from ..layers.blocks import Branch, block_fp32_params, pre_norm_block, run_blocks
from ..layers.linear import linear
from ..layers.mlp import Mlp
from ..layers.norm import LayerNorm
from ..layers.patch import PatchEmbed
from .base import Workload
from .data import ImageFiles, classification_images, normalize_images


@dataclass(frozen=True)
class ViTConfig:
    image: int = 224
    patch: int = 16
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000


CONFIGS = {
    "tiny": ViTConfig(image=32, patch=8, dim=64, depth=2, heads=2, mlp=128, classes=10),
    "base": ViTConfig(),
    "large": ViTConfig(dim=1024, depth=24, heads=16, mlp=4096),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention. Plain: the qkv projection viewed as (3, B, heads, T, D), SDPA,
    the heads put back side by side. Fused (``kernels=attention``): ``kernels.seq_attention``,
    one Triton kernel each way straight from the qkv projection's (B, T, 3·C) output, which
    writes (B, T, C) and, backward, the qkv gradient in that layout (no permutes, no stack of
    dq, dk, dv); the backward kernels also sum the qkv bias's gradient."""

    fused_kind, fused_triton, replaces_sdpa = "attention", True, True
    attention_name = "self-attention"

    def __init__(self, dim: int, heads: int, batch_second: bool = False):
        super().__init__()
        self.heads, self.batch_second, self.fused = heads, batch_second, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["self-attention from the qkv projection's layout in one Triton kernel each way"]

    def forward(self, x: torch.Tensor, mask: None = None, proj_bias: bool = True
                ) -> torch.Tensor:
        """``proj_bias=False`` leaves the output projection's bias out, for the caller to add."""
        if self.fused:  # (B, T, C), or (T, B, C) batch second, in and out
            from ..kernels.seq_attention import projected_seq_attention, seq_attention

            if type(self.qkv) is nn.Linear:
                out = projected_seq_attention(x, self.qkv.weight, self.qkv.bias, self.heads,
                                              batch_second=self.batch_second)
            else:  # another technique's linear layer (fp8): its own forward and bias gradient
                out = seq_attention(self.qkv(x), self.heads, batch_second=self.batch_second)
        elif self.batch_second:  # (T, B, C) → heads-major (3, B, H, T, D)
            T, B, C = x.shape
            qkv = self.qkv(x).view(T, B, 3, self.heads, C // self.heads).permute(2, 1, 3, 0, 4)
            out = attention(*qkv.unbind(0))  # (B, H, T, D)
            out = out.permute(2, 0, 1, 3).reshape(T, B, C)
        else:
            B, T, C = x.shape
            qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            out = attention(*qkv.unbind(0)).transpose(1, 2).reshape(B, T, C)  # from (B, H, T, D)
        return linear(self.proj, out, bias=proj_bias)


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig, batch_second: bool):
        super().__init__()
        self.norm1 = LayerNorm(cfg.dim, eps=1e-6, feeds_matmul=True)
        self.attn = SelfAttention(cfg.dim, cfg.heads, batch_second)
        self.norm2 = LayerNorm(cfg.dim, eps=1e-6, feeds_matmul=True)
        self.mlp = Mlp(cfg.dim, cfg.mlp)

    def forward(self, x: torch.Tensor, branch: Branch = None, hand_on: bool = False
                ) -> tuple[torch.Tensor, Branch]:
        """``branch``, ``hand_on``: see ``run_blocks``."""
        return pre_norm_block(self, x, branch, hand_on)

    def fp32_params(self) -> list[nn.Parameter]:
        return block_fp32_params(self)


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig, pool: str = "cls", batch_second: bool = False):
        super().__init__()
        self.cfg, self.pool, self.batch_second = cfg, pool, batch_second
        self.channels_last = False  # set by the channels_last technique
        self.stream_dtype: torch.dtype | None = None  # set by the stream_dtype technique
        tokens = (cfg.image // cfg.patch) ** 2 + (1 if pool == "cls" else 0)
        self.patch_embed = PatchEmbed(3, cfg.dim, cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if pool == "cls" else None
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, batch_second) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        # the model's own dtype (bf16 with bf16-true), which its norms keep: the matmul
        # weights are bf16 also under bf16-mixed with master weights
        x = normalize_images(images, self.norm.weight.dtype, self.channels_last)
        x = self.patch_embed.tokens(x).flatten(1, 2)  # (B, N, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        if self.batch_second:
            x = x.transpose(0, 1)  # (T, B, C)
        x = self.norm(run_blocks(self.blocks, x))
        tok_dim = 0 if self.batch_second else 1
        return x.select(tok_dim, 0) if self.pool == "cls" else x.mean(tok_dim)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(images))
        return F.cross_entropy(logits.float(), labels, reduction="sum")


class ViTWorkload(Workload):
    name, unit, conv = "vit", "img", True

    def __init__(self, size: str, seed: int, data: str | None, pool: str, batch_second: bool):
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', not {pool!r}")
        self.size, self.seed, self.data_dir = size, seed, data
        self.cfg = CONFIGS[size]
        self.pool, self.batch_second = pool, bool(batch_second)
        self.default_batch = {"tiny": 8, "base": 128, "large": 64}[size]

    def build_model(self) -> nn.Module:
        return ViT(self.cfg, self.pool, self.batch_second)

    def dataset(self) -> ImageFiles:
        return classification_images(self.data_dir, self.cfg.image, self.cfg.classes,
                                     tiny=self.size == "tiny", seed=self.seed)


def make(size: str = "tiny", seed: int = 0, data: str | None = None, pool: str = "cls",
         batch_second: bool = False) -> ViTWorkload:
    return ViTWorkload(size, seed, data, pool, batch_second)
