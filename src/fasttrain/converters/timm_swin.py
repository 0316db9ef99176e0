"""Converter for timm's Swin Transformer v1 block (``timm.models.swin_transformer``).

``SwinTransformerBlock`` (norm1 → roll, window partition, ``WindowAttention`` with the relative
position bias and the shift mask, window reverse, roll back → residual; norm2 → ``Mlp`` →
residual) → a fasttrain pre-norm block whose attention is ``layers.windows.WindowAttention``:
with ``kernels=window`` the map-mode Triton kernel finds each window's tokens by address and adds
bias and mask inside, one kernel each way straight from the qkv projection (no roll, partition or
reverse in memory); the norms and the MLP convert as ViT's (``timm_vit.py``), and each stage's
``blocks`` stack runs as one chain. The block's own ``attn_mask`` buffer is the shift mask the
kernel reads. Windows that need padding (a map that does not tile), rectangular windows, a
mask computed at every call (``dynamic_mask``) and dropout stay timm's; stochastic depth is applied
to the branches as timm applies it.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.blocks import Branch, ChainLink, Post, block_fp32_params, pre_norm_block
from ..layers.windows import WindowAttention
from .registry import Converter, class_path
from .timm_vit import (dropout_p, is_identity, norms_and_mlp_unsupported, plain_linear,
                       qkv_unsupported, swap_norms_and_mlp)

BLOCK = ("timm.models.swin_transformer.SwinTransformerBlock",)
WINDOW_ATTENTION = ("timm.models.swin_transformer.WindowAttention",)


class TimmSwinBlock(ChainLink, nn.Module):
    """timm's ``SwinTransformerBlock`` as a fasttrain pre-norm block over the (B, H, W, C) map."""

    def forward(self, x: torch.Tensor, *, branch: Branch = None, hand_on: bool = False,
                chained: bool = False):
        x, branch = pre_norm_block(self, x, branch, hand_on, self.attn_mask, self.post())
        return (x, branch) if chained else x

    def post(self) -> Post:
        """Stochastic depth on each branch where the model has it, or None."""
        if is_identity(self.drop_path1) and is_identity(self.drop_path2):
            return None
        return (self.drop_path1, self.drop_path2)

    def fp32_params(self) -> list[nn.Parameter]:
        return block_fp32_params(self, self.post())


def square(pair) -> int | None:
    a, b = (pair, pair) if isinstance(pair, int) else tuple(pair)
    return a if a == b else None


def window_attention_unsupported(a: nn.Module) -> str | None:
    if class_path(a) not in WINDOW_ATTENTION:
        return f"attention {type(a).__name__} is not timm's WindowAttention"
    if not plain_linear(a.qkv, a.proj):
        return "qkv or proj is not a plain nn.Linear"
    if dropout_p(a.attn_drop, a.proj_drop) > 0:
        return "attention dropout is not in the fused window attention"
    return qkv_unsupported(a)


def block_unsupported(m: nn.Module) -> str | None:
    window, shift = square(m.window_size), square(m.shift_size)
    if window is None or shift is None:
        return f"window {tuple(m.window_size)} or shift {tuple(m.shift_size)} is not square"
    H, W = m.input_resolution
    if H % window or W % window:
        return f"a {H}x{W} map does not tile into {window}x{window} windows (timm pads it)"
    if getattr(m, "dynamic_mask", False):
        return "dynamic_mask (the mask made at every call) is not in the fused block"
    if shift and m.attn_mask is None:
        return "a shifted block without its attn_mask buffer"
    return window_attention_unsupported(m.attn) or norms_and_mlp_unsupported(m)


def swap_block(m: nn.Module) -> None:
    swap_norms_and_mlp(m)
    a = m.attn
    a.heads, a.window, a.shift = a.num_heads, square(m.window_size), square(m.shift_size)
    a.fused = False
    a.__class__ = WindowAttention
    m.__class__ = TimmSwinBlock


def block_sample(m: nn.Module, gen: torch.Generator) -> tuple:
    H, W = m.input_resolution
    return (torch.randn(1, H, W, m.norm1.normalized_shape[0], generator=gen),), {}


CONVERTERS = (
    Converter("timm Swin block", BLOCK, "fasttrain pre-norm block with map-mode window attention "
              "(kernels=window; fused norms with the residual adds, GELU and LayerNorm kernels)",
              block_unsupported, swap_block, block_sample),
)
