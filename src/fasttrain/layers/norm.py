"""GroupNorm with an optional SiLU after it (the UNet's and the VAE's "GN → SiLU → conv").

Fused path (``kernels=groupnorm``, Triton, ``kernels/group_norm.py``): the norm, its affine and
the SiLU in two passes each way that read channels-last activations in place. Parameters and
their names are those of ``nn.GroupNorm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm``, followed by SiLU when ``silu``."""

    fused_kind, fused_triton = "groupnorm", True

    def __init__(self, groups: int, channels: int, eps: float = 1e-5, silu: bool = False):
        super().__init__(groups, channels, eps=eps)
        self.silu, self.fused = silu, False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return [f"GroupNorm{' + SiLU' if self.silu else ''} in Triton (two passes each way)"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.group_norm import group_norm

            return group_norm(x, self.weight, self.bias, self.num_groups, self.eps, self.silu)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y

    def extra_repr(self) -> str:
        return super().extra_repr() + (", silu" if self.silu else "")
