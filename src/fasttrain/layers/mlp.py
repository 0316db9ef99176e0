"""Feed-forward blocks: GELU MLP (ViT, Swin, CLIP) and SwiGLU (Llama)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    """Linear → GELU → Linear. ``approximate='tanh'`` gives CLIP's quick-GELU family shape."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (Llama)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
