"""A linear layer's matmul with or without its bias, for fused paths that add the bias
themselves (bias + GELU, the blocks' fused LayerNorms)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fp8_linear as fp8


def linear(layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``layer(x)``; with ``bias=False`` without the bias, which a fused kernel adds instead: the
    layer's own matmul, in float8 where the fp8 technique made it a ``Float8Linear``."""
    if bias:
        return layer(x)
    if isinstance(layer, fp8.Float8Linear):
        return fp8.fp8_linear(x, layer.weight, None)
    return F.linear(x, layer.weight)
