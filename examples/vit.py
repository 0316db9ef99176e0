"""A Vision Transformer written in plain PyTorch as a fasttrain workload (nothing in the model
knows about fasttrain): LayerNorm, a fused-QKV attention through
``F.scaled_dot_product_attention``, and an ``nn.Sequential`` MLP with GELU, as most ViT code
writes it.

    fasttrain ladder examples.vit:make_workload                      # tiny, on any machine
    fasttrain ladder examples.vit:make_workload --size base --peer   # ViT-B/16 on a GPU

``base`` is ViT-B/16 at 224 px (86 M parameters), batch 128, 1,000 classes; the images are
random (the step's speed does not depend on them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain import SimpleWorkload


@dataclass(frozen=True)
class ViTConfig:
    image: int = 224
    patch: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    classes: int = 1000


SIZES = {"tiny": ViTConfig(image=32, patch=8, width=64, layers=2, heads=2, classes=10),
         "base": ViTConfig()}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.width, cfg.patch, stride=cfg.patch)
        tokens = (cfg.image // cfg.patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos = nn.Parameter(torch.randn(1, tokens, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6)
        self.head = nn.Linear(cfg.width, cfg.classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class RandomImages(torch.utils.data.Dataset):
    """Random images and labels, made per item: enough of them that a short run never sees a
    batch twice (a repeated batch is memorised, and its loss falls towards 0)."""

    def __init__(self, cfg: ViTConfig, n: int = 8192, seed: int = 0):
        self.cfg, self.n, self.seed = cfg, n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        image = torch.randn(3, self.cfg.image, self.cfg.image, generator=g)
        return {"images": image, "labels": torch.randint(0, self.cfg.classes, (), generator=g)}


def make_workload(size: str = "tiny", seed: int = 0, data=None) -> SimpleWorkload:
    if size not in SIZES:
        raise ValueError(f"size {size!r}: use tiny or base")
    cfg = SIZES[size]
    return SimpleWorkload(
        name=f"plain-vit-{size}", size=size,
        build=lambda: ViT(cfg),
        data=lambda: RandomImages(cfg, seed=seed),
        loss_fn=lambda model, b: F.cross_entropy(model(b["images"]), b["labels"], reduction="sum"),
        unit="img", default_batch=128 if size == "base" else 8,
    )
