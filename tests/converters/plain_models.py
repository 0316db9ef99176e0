"""Plain-PyTorch models and layers (nothing in them knows about fasttrain) for the torch.nn
converters' and the SDPA route's tests, CPU (test_torch_nn.py) and GPU (test_torch_nn_gpu.py):
a nanoGPT-style GPT, a ViT as plain code writes it, an nn.TransformerEncoder classifier."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def randomise(module: nn.Module, seed: int = 0) -> nn.Module:
    """Weights and biases off their init (ones and zeros would hide a dropped affine)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype), alpha=0.3)
    return module


def packed_qkv(x: torch.Tensor, w: torch.Tensor, heads: int, layout: str):
    """(B, H, T, D) q, k and v as views of one projection output, as plain code makes them."""
    B, T, C = x.shape
    qkv = F.linear(x, w)
    if layout == "vit":
        return qkv.reshape(B, T, 3, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)
    return tuple(t.view(B, T, heads, C // heads).transpose(1, 2) for t in qkv.split(C, dim=2))


class PackedAttention(nn.Module):
    """As nanoGPT and plain ViT code write it: the projection's output split into q, k, v."""

    def __init__(self, dim: int = 24, heads: int = 3, causal: bool = False, layout: str = "vit"):
        super().__init__()
        self.heads, self.causal, self.layout = heads, causal, layout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x)
        if self.layout == "vit":
            q, k, v = qkv.reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = PackedAttention(dim, heads, causal=True, layout="gpt")
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, seq: int = 12, dim: int = 24, heads: int = 3,
                 layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = PackedAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, image: int = 16, patch: int = 4, dim: int = 24, heads: int = 3,
                 layers: int = 2, classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class TinyEncoder(nn.Module):
    """nn.TransformerEncoder (dropout 0, GELU, batch first) over tokens, mean-pooled."""

    def __init__(self, vocab: int = 40, dim: int = 24, heads: int = 3, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))
