"""The transformer block of SD v1's spatial transformers (diffusers' ``BasicTransformerBlock``):
pre-LN self-attention, cross-attention to the text, GEGLU feed-forward, with the attention it is
built from; ``layers/unet.py``'s spatial transformer holds it. Module names follow diffusers."""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention
from .linear import bias_apart, linear, stackable, stacked_params
from .mlp import GEGLU
from .norm import LayerNorm

Heads2 = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Multi-head attention, q/k/v without bias; cross-attention when ``context`` is given.

    Projections of the same input run as one GEMM over their stacked weights: q, k and v of
    self-attention, k and v of the text. One launch reads the input once, and the backward gets
    the input's gradient from one GEMM rather than three and their sum (at 64 × 64 latents,
    4.25 → 4.16 ms for a transformer's forward and backward: sd-block-micro-20261122-0805).
    The weights stay in diffusers' separate ``to_q``/``to_k``/``to_v``; layers another technique
    replaced (float8) keep their own matmuls. ``stacked = False`` runs one GEMM per projection
    (benchmarks/kernels/sd_block_micro.py measures both)."""

    stacked = True

    def __init__(self, dim: int, heads: int, context: int | None = None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context or dim, dim, bias=False)
        self.to_v = nn.Linear(context or dim, dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim))  # diffusers' to_out.0

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                proj_bias: bool = True, kv: Heads2 | None = None) -> torch.Tensor:
        """``proj_bias=False`` leaves to_out's bias out, for the caller's norm to add; ``kv``:
        the context's keys and values already projected (``text_heads``), else they are
        projected here."""
        B, T, C = x.shape
        if context is None:
            q, k, v = self._project(x, self.to_q, self.to_k, self.to_v)
        elif kv is not None:
            (q,), (k, v) = self._project(x, self.to_q), kv
        else:
            (q,), (k, v) = self._project(x, self.to_q), self._project(context, self.to_k, self.to_v)
        out = attention(q, k, v)  # (B, H, T, D)
        return linear(self.to_out[0], out.transpose(1, 2).reshape(B, T, C), bias=proj_bias)

    def _project(self, x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
        """Each layer's output as (B, heads, T, D), from one GEMM where all are plain."""
        if self.stacked and stackable(layers):
            return self._heads(F.linear(x, *stacked_params(layers)), len(layers))
        return tuple(h for m in layers for h in self._heads(m(x), 1))

    def text_heads(self, k: torch.Tensor, v: torch.Tensor) -> Heads2:
        """The outputs of to_k and to_v, (B, T, C) each, as the (B, heads, T, D) views
        ``forward``'s ``kv`` takes."""
        return self._heads(k, 1)[0], self._heads(v, 1)[0]

    def _heads(self, y: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """(B, T, n·C) → n views (B, heads, T, D). One is a view without ``unbind``, whose
        backward (a ``stack``) would copy its gradient."""
        B, T, _ = y.shape
        if n == 1:
            return (y.view(B, T, self.heads, -1).transpose(1, 2),)
        return y.view(B, T, n, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


class FeedForward(nn.Module):
    """GEGLU feed-forward, inner width 4·dim (keys net.0.proj / net.2; net.1 is a no-op dropout)."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(OrderedDict(
            [("0", GEGLU(dim, mult * dim)), ("2", nn.Linear(mult * dim, dim))]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """diffusers ``BasicTransformerBlock``: pre-LN self-attn, cross-attn, GEGLU feed-forward.

    With fused LayerNorms (``kernels=layernorm``) norm2 and norm3 take the residual add before
    them and the bias of the attention output projection before that (``LayerNorm.add``): one
    pass each way instead of an add, a norm and the bias gradient's own reduction (4.16 → 3.97
    ms for a transformer at 64 × 64 latents: sd-block-micro-20261122-0805)."""

    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.norm1 = LayerNorm(dim, feeds_matmul=True)
        self.attn1 = Attention(dim, heads)
        self.norm2 = LayerNorm(dim, feeds_matmul=True)
        self.attn2 = Attention(dim, heads, context)
        self.norm3 = LayerNorm(dim, feeds_matmul=True)
        self.ff = FeedForward(dim)

    def _fuse_biases(self) -> bool:
        """Whether the fused norms add the attention output projections' biases: on the fused
        path, where both projections run their matmul apart from the bias (``bias_apart``)."""
        return (self.norm2.takes_bias() and bias_apart(self.attn1.to_out[0])
                and bias_apart(self.attn2.to_out[0]))

    def fp32_params(self) -> list[nn.Parameter]:
        """The output projections' biases the fused norms add themselves, outside autocast's
        casts (bf16 master weights leave them fp32, techniques/optimizer.py)."""
        if not self._fuse_biases():
            return []
        return [a.to_out[0].bias for a in (self.attn1, self.attn2)]

    def forward(self, x: torch.Tensor, context: torch.Tensor, kv: Heads2 | None = None
                ) -> torch.Tensor:
        """``kv``: the text's keys and values for attn2, already projected (or None)."""
        fuse = self._fuse_biases()
        a = self.attn1(self.norm1(x), proj_bias=not fuse)
        y, x = self.norm2.add(a, x, self.attn1.to_out[0].bias if fuse else None)
        a = self.attn2(y, context, proj_bias=not fuse, kv=kv)
        y, x = self.norm3.add(a, x, self.attn2.to_out[0].bias if fuse else None)
        return x + self.ff(y)
