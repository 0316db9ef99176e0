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

from ..layers.attention import SelfAttention
from ..layers.blocks import Branch, block_fp32_params, pre_norm_block, run_blocks
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
