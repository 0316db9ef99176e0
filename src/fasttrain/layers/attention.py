"""Attention through torch's scaled_dot_product_attention.

Which kernel SDPA picks (flash, memory-efficient, cuDNN, math) is decided by the attention
technique with ``torch.nn.attention.sdpa_kernel`` around the step, never here, so every model
gets the same switch. Inputs are (B, heads, T, head_dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              bias: torch.Tensor | None = None, causal: bool = False,
              enable_gqa: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v ; ``bias`` is additive (B or 1, heads or 1, Tq, Tk)."""
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                          enable_gqa=enable_gqa)
