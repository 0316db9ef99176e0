"""Norm layers with a fused path.

``GroupNorm``: GroupNorm with an optional SiLU after it (the UNet's and the VAE's "GN → SiLU →
conv"). Fused (``kernels=groupnorm``, Triton, ``kernels/group_norm.py``): the norm, its affine
and the SiLU in two passes each way that read channels-last activations in place.

``LayerNorm``: LayerNorm that can also take the residual add before it (``add``), for pre-norm
blocks. Fused (``kernels=layernorm``, Triton, ``kernels/norms.py``): the add and the norm in one
pass over tiles of whole rows, the backward in one pass that also sums the weight and bias
gradients, and, when the block leaves the bias of the branch's last linear layer to it, that
bias's gradient too. ``layers/blocks.py`` chains blocks so the MLP branch of one is added by
the next block's first norm (ViT, Swin).

``RMSNorm``: the same for RMSNorm (``kernels=rmsnorm``, the same kernels without the mean):
Llama's blocks hand their MLP branch to the next block's first norm, the last one's to the
final norm.

Parameters and their names are those of the ``nn`` module each subclasses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath


class GroupNorm(FusedPath, nn.GroupNorm):
    """``nn.GroupNorm``, followed by SiLU when ``silu``. ``forward(x, x_bias)`` normalizes
    ``x + x_bias``; ``x_bias_from`` names what its callers hand it (the fused path says so)."""

    fused_kind, fused_triton = "groupnorm", True

    def __init__(self, groups: int, channels: int, eps: float = 1e-5, silu: bool = False,
                 x_bias_from: str | None = None):
        super().__init__(groups, channels, eps=eps)
        self.silu, self.fused, self.x_bias_from = silu, False, x_bias_from

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        extra = f", {self.x_bias_from} added in its kernels" if self.x_bias_from else ""
        return [f"GroupNorm{' + SiLU' if self.silu else ''} in Triton (two passes each way)"
                + extra]

    def takes_bias(self) -> bool:
        """Whether the caller should hand over its convolution's bias (``x_bias``) instead of
        adding it: on the fused path, where ``x + x_bias`` is never written."""
        return self.fused and self.x_bias_from is not None

    def shared_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as one buffer where this norm's kernels and another reader share it (a ResNet
        block's input feeds norm1 and the shortcut): under torch.compile Inductor would otherwise
        write a copy of ``x`` for each kernel. Frozen inputs only (``realized`` is a prim without
        a backward); elsewhere, and on the plain path, ``x`` itself."""
        if not self.fused or (torch.is_grad_enabled() and x.requires_grad):
            return x
        from ..kernels._triton import realized

        return realized(x)

    def forward(self, x: torch.Tensor, x_bias: torch.Tensor | None = None) -> torch.Tensor:
        """GroupNorm (+ SiLU) of ``x + x_bias``; x_bias is (channels,) or (batch, channels).
        The fused kernels add it in fp32; the plain path rounds ``x + x_bias`` to x's dtype
        first, as a convolution's own bias add would."""
        if self.fused:
            from ..kernels.group_norm import group_norm

            return group_norm(x, self.weight, self.bias, self.num_groups, self.eps, self.silu,
                              x_bias=x_bias)
        if x_bias is not None:
            x = x + x_bias.reshape(*x_bias.shape, *(1,) * (x.dim() - 2)).to(x.dtype)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y

    def extra_repr(self) -> str:
        return super().extra_repr() + (", silu" if self.silu else "")


class _FusedNorm(FusedPath):
    """What LayerNorm and RMSNorm share: the switch, and the dtype their fused kernels write."""

    feeds_matmul: bool
    fused: bool
    norm_name: str

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return [f"{self.norm_name} (with the residual add before it) in Triton"]

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        if not torch.is_autocast_enabled(x.device.type):
            return None
        return torch.get_autocast_dtype(x.device.type) if self.feeds_matmul else torch.float32


class LayerNorm(_FusedNorm, nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim; ``add(x, residual)`` normalizes ``x + residual`` and
    returns ``(norm, sum)``. ``feeds_matmul``: the output goes into a linear layer, so under
    autocast the fused kernel writes it in the autocast dtype the matmul takes (the plain path
    writes fp32 and the matmul casts it); otherwise it comes out as the plain path's would."""

    fused_kind, fused_triton, norm_name = "layernorm", True, "LayerNorm"

    def __init__(self, dim: int, eps: float = 1e-5, feeds_matmul: bool = False):
        super().__init__(dim, eps=eps)
        self.feeds_matmul, self.fused = feeds_matmul, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.norms import layer_norm

            return layer_norm(x, self.weight, self.bias, self.eps, out_dtype=self._out_dtype(x))
        return super().forward(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor, x_bias: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` for ``h = x + x_bias + residual``. ``x_bias``: the bias of the linear
        layer that made x, left out of its matmul (see ``takes_bias``); the fused kernel adds it
        and sums its gradient in the backward's one pass."""
        if self.fused:
            from ..kernels.norms import layer_norm

            return layer_norm(x, self.weight, self.bias, self.eps, residual=residual,
                              out_dtype=self._out_dtype(x), x_bias=x_bias)
        h = x + residual if x_bias is None else (x + x_bias).to(x.dtype) + residual
        return super().forward(h), h

    def takes_bias(self) -> bool:
        """Whether ``add`` should get the branch's bias rather than the matmul: on the fused
        path, where it saves the bias gradient's own reduction over the activations."""
        return self.fused


class RMSNorm(_FusedNorm, nn.RMSNorm):
    """``nn.RMSNorm`` over the last dim; ``add(x, residual)`` normalizes ``x + residual`` and
    returns ``(norm, sum)``; ``feeds_matmul`` as for ``LayerNorm``. ``eps=None`` (an
    ``nn.RMSNorm``'s default) is fp32's machine epsilon, as torch takes it: that of the type
    it computes in (its ``opmath`` type, fp32 for bf16 and fp16 inputs too, whatever its
    documentation says of the input's dtype; torch 2.13)."""

    fused_kind, fused_triton, norm_name = "rmsnorm", True, "RMSNorm"

    def __init__(self, dim: int, eps: float = 1e-6, feeds_matmul: bool = False):
        super().__init__(dim, eps=eps)
        self.feeds_matmul, self.fused = feeds_matmul, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.norms import rms_norm

            return rms_norm(x, self.weight, self._eps(x), out_dtype=self._out_dtype(x))
        return super().forward(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` for ``h = x + residual``, in one pass on the fused path."""
        if self.fused:
            from ..kernels.norms import rms_norm

            return rms_norm(x, self.weight, self._eps(x), residual=residual,
                            out_dtype=self._out_dtype(x))
        h = x + residual
        return super().forward(h), h

    def _eps(self, x: torch.Tensor) -> float:
        return self.eps if self.eps is not None else torch.finfo(torch.float32).eps
