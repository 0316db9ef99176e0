"""Rotary position embeddings (RoPE) of q and k, half-split layout (as transformers' Llama).

Plain: ``x · cos + rotate_half(x) · sin`` for q and k, in their dtype. Fused (``kernels=rope``,
Triton, ``kernels/rope.py``): q and k rotated in one kernel each way. The layer has no
parameters; the cos and sin tables are the model's.
"""
from __future__ import annotations

import torch
from torch import nn

from .fused import FusedPath


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by position, in the dtype of ``x``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Rotary(FusedPath, nn.Module):
    """Rotates (B, H, T, D) q and (B, KV, T, D) k by position: ``(q, k, cos, sin) -> (q, k)``."""

    fused_kind, fused_triton = "rope", True

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["RoPE of q and k in one Triton kernel"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from ..kernels.rope import rope

            return rope(q, k, cos, sin)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
