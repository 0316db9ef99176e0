"""A GPT-2 written in plain PyTorch (nanoGPT style) as a fasttrain workload: nothing in the model
knows about fasttrain.

    fasttrain ladder examples.gpt:make_workload                      # tiny, on any machine
    fasttrain ladder examples.gpt:make_workload --size base --peer   # GPT-2 small on a GPU

``base`` is GPT-2 small: 12 layers, 12 heads, width 768, 1,024 tokens, the 50,257-token
vocabulary (124 M parameters), batch 16. An item is a token: fasttrain counts the labels and
divides the summed loss by that count, so the loss is the mean over tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain import SimpleWorkload


@dataclass(frozen=True)
class GPTConfig:
    seq: int = 1024
    vocab: int = 50257
    layers: int = 12
    heads: int = 12
    width: int = 768


SIZES = {"tiny": GPTConfig(seq=64, vocab=512, layers=2, heads=2, width=64),
         "base": GPTConfig()}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width)
        self.c_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RandomTokens(torch.utils.data.Dataset):
    """Windows of random tokens: inputs and next-token labels (a stand-in for a token file)."""

    def __init__(self, cfg: GPTConfig, n: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, cfg.vocab, (n, cfg.seq + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"x": self.tokens[i, :-1], "y": self.tokens[i, 1:]}


def summed_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["y"].reshape(-1),
                           reduction="sum", ignore_index=-100)


def make_workload(size: str = "tiny", seed: int = 0, data=None) -> SimpleWorkload:
    if size not in SIZES:
        raise ValueError(f"size {size!r}: use tiny or base")
    cfg = SIZES[size]
    return SimpleWorkload(
        name=f"gpt-{size}", size=size,
        build=lambda: GPT(cfg),
        data=lambda: RandomTokens(cfg, seed=seed),
        loss_fn=summed_loss,
        unit="token", count_field="y", ignore_index=-100,
        default_batch=16 if size == "base" else 4,
    )
