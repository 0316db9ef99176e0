"""Feed-forward blocks: GELU MLP (ViT, Swin), SwiGLU (Llama) and GEGLU (SD).

Fused paths (``kernels=gelu`` / ``kernels=swiglu``, Triton, ``kernels/activations.py``): fc1's
bias add and the GELU in one kernel each way (fc1 runs without its bias), and SiLU(gate)·up in
one kernel each way. Parameters and their names are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath
from .linear import linear


class Mlp(FusedPath, nn.Module):
    """Linear → GELU → Linear. ``approximate='tanh'`` gives the tanh-GELU variant."""

    fused_kind, fused_triton = "gelu", True

    def __init__(self, dim: int, hidden: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.approximate, self.fused = approximate, False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["bias + GELU in one Triton kernel"]

    def fp32_params(self) -> list[nn.Parameter]:
        """What the fused path reads outside autocast's casts: fc1's bias, added in fp32 inside
        the kernel (bf16 master weights leave it fp32, techniques/optimizer.py)."""
        return [self.fc1.bias] if self.fused and self.fc1.bias is not None else []

    def forward(self, x: torch.Tensor, fc2_bias: bool = True) -> torch.Tensor:
        """``fc2_bias=False`` leaves fc2's bias out, for the caller to add (``LayerNorm.add``)."""
        if self.fused:
            from ..kernels.activations import bias_gelu

            h = bias_gelu(linear(self.fc1, x, bias=False), self.fc1.bias, self.approximate)
        else:
            h = F.gelu(self.fc1(x), approximate=self.approximate)
        return linear(self.fc2, h, bias=fc2_bias)


class SwiGLU(FusedPath, nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (Llama)."""

    fused_kind, fused_triton = "swiglu", True

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused = False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["SiLU(gate) · up in one Triton kernel"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.activations import swiglu

            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GEGLU(FusedPath, nn.Module):
    """``h · gelu(gate)`` of the two halves of one projection. Fused (``kernels=gelu``): the
    projection runs without its bias and one Triton kernel each way reads its output in place,
    adds the bias and, backward, sums the bias gradient (``kernels/geglu.py``); Inductor's
    backward computed GELU's derivative for both halves of its gradient (0.30 ms a call at
    64 × 64 latents: profile-sd-base-20261122-035033) and the bias gradient in a pass of its own
    (0.07 ms: profile-sd-base-20261122-081837)."""

    fused_kind, fused_triton = "gelu", True

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)
        self.fused = False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["GEGLU (bias, h · gelu(gate)) in one Triton kernel each way"]

    def fp32_params(self) -> list[nn.Parameter]:
        """What the fused path reads outside autocast's casts: the projection's bias, added in
        fp32 in the kernel (bf16 master weights leave it fp32, techniques/optimizer.py)."""
        return [self.proj.bias] if self.fused else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.geglu import geglu

            return geglu(linear(self.proj, x, bias=False), self.proj.bias)
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)
