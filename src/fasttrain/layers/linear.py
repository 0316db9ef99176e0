"""A linear layer's matmul with or without its bias, for fused paths that add the bias
themselves (bias + GELU, the blocks' fused LayerNorms), the outputs of several linear
layers of one input from one GEMM (``stacked``), and a linear layer whose GEMM runs on an
output width padded to a multiple of N (``PaddedLinear``, the ``gemm_pad`` switch), and one
whose three matmuls run in float8 (``Float8Linear``, the ``fp8`` switch). ``BiasApart`` is
what a linear layer of another kind (the inference path's 8-bit ones) implements to keep the
fused paths."""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fp8_linear as fp8


class BiasApart:
    """A linear layer that can run its matmul without its bias, so that a fused path adds the
    bias itself (``linear(layer, x, bias=False)``): it keeps the bias to add as ``bias`` and
    computes the rest in ``unbiased``. fasttrain's swaps of ``nn.Linear`` are such layers, and so
    are the inference path's fp8 and INT8 layers, which is what lets the blocks' fused norms and
    the bias + GELU kernel keep working on a quantized model."""

    bias: torch.Tensor | None

    def unbiased(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` less the bias."""
        raise NotImplementedError


class PaddedLinear(BiasApart, nn.Linear):
    """``nn.Linear`` whose GEMM runs on ``padded`` outputs (out_features rounded up to a multiple
    of N): the weight (and bias) padded with zero rows inside the forward, where compile fuses
    the padding into autocast's cast of the weight, and the extra outputs sliced off. The
    parameters, their shapes and names stay those of the ``nn.Linear`` (checkpoints, optimizer
    state); their gradients come back unpadded. Numerics: none — the padded rows are zeros and
    are never read. Set by ``techniques/gemm_pad.py`` (class swap, as fp8's)."""

    padded: int

    def matmul(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        extra = self.padded - self.out_features
        w = F.pad(self.weight, (0, 0, 0, extra))  # (padded, in)
        b = None if not bias or self.bias is None else F.pad(self.bias, (0, extra))
        return F.linear(x, w, b)[..., :self.out_features]  # (..., out), a view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def unbiased(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, bias=False)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", padded={self.padded}"


class Float8Linear(BiasApart, nn.Linear):
    """An ``nn.Linear`` whose forward runs ``kernels.fp8_linear.fp8_linear``: same parameters, same state dict.

    The fp8 technique turns a model's ``nn.Linear`` layers into this class in place
    (``module.__class__``), so optimizers, hooks and checkpoints see the same module.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.fp8_linear(x, self.weight, self.bias)

    def unbiased(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.fp8_linear(x, self.weight, None)


FP8_ALIGN, FP8_LARGE = fp8.ALIGN, fp8.LARGE  # the shapes and sizes the fp8 switch picks


def linear(layer: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``layer(x)``; with ``bias=False`` without the bias, which a fused kernel adds instead: the
    layer's own matmul, in float8 where the fp8 technique made it a ``Float8Linear``, on padded
    outputs where ``gemm_pad`` made it a ``PaddedLinear``, in 8 bits where the inference path
    quantized it (any ``BiasApart``)."""
    if bias:
        return layer(x)
    if isinstance(layer, BiasApart):
        return layer.unbiased(x)
    return F.linear(x, layer.weight)


def bias_apart(layer: nn.Module) -> bool:
    """Whether ``linear(layer, x, bias=False)`` computes ``layer(x)`` less its bias: a plain
    ``nn.Linear`` or one of the kinds fasttrain swaps in (``BiasApart``). A layer another library
    put in its place (a LoRA wrapper, say) does more than its weight, so a fused path that adds
    the bias itself must call it whole instead."""
    return type(layer) is nn.Linear or (isinstance(layer, BiasApart)
                                        and _forward_beside_unbiased(type(layer)))


@functools.cache
def _forward_beside_unbiased(cls: type) -> bool:
    """Whether ``cls``'s forward is defined where its ``unbiased`` is, or above: a subclass
    that overrides ``forward`` alone (a wrapper that does more than the matmul) would have
    ``unbiased`` skip its extra work. Once a class: the fused paths ask at every forward."""
    owner = {name: next(c for c in cls.__mro__ if name in c.__dict__)
             for name in ("forward", "unbiased")}
    return owner["forward"] in owner["unbiased"].__mro__


def _plain(p: torch.Tensor | None) -> bool:
    """A parameter held as a plain tensor: not a tensor subclass such as FSDP2's sharded
    DTensor, which only its own module's forward gathers."""
    return p is None or type(p) in (torch.Tensor, nn.Parameter)


def stackable(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` can run as one GEMM: two or more plain ``nn.Linear`` (not a subclass
    another technique swapped in, such as fp8's) with the same input width, all with a bias or
    none, their weights plain tensors (not FSDP2's shards, outside their module's forward)."""
    return (len(layers) > 1 and all(type(m) is nn.Linear for m in layers)
            and all(_plain(m.weight) and _plain(m.bias) for m in layers)
            and len({m.in_features for m in layers}) == 1
            and len({m.bias is None for m in layers}) == 1)


def stacked_params(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``stackable`` layers' weights (and biases) concatenated along their outputs: one
    linear layer's (weight, bias) whose output is theirs side by side."""
    bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
    return torch.cat([m.weight for m in layers]), bias


def stacked(layers: Sequence[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """``[m(x) for m in layers]``, from one GEMM over the layers' concatenated weights (and
    biases) where they are ``stackable``: one launch forward, one for the weights' gradient and
    one for x's (instead of one each per layer, and a sum of x's gradients); the outputs are
    column slices of the one result. The weights stay the layers' own parameters."""
    if not stackable(layers):
        return [m(x) for m in layers]
    y = F.linear(x, *stacked_params(layers))
    return list(y.split([m.out_features for m in layers], dim=-1))
