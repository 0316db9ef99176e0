"""Swin's window attention: multi-head attention within the windows of a (B, H, W, C) token
map, with the learned relative position bias and, for shifted windows, the shift mask.

Plain: roll, partition into windows, SDPA with bias and mask as one additive mask, reverse, roll
back (``kernels/windows.py``'s bookkeeping). Fused (``kernels=window``): the map-mode Triton
kernel (``kernels/window_attention.py``) finds each window's tokens by address and adds bias and
mask inside, one kernel each way, straight from the qkv projection. Parameter names follow the
official Swin (and timm): ``qkv``, ``proj``, ``relative_position_bias_table``.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from ..kernels.windows import cyclic_shift, window_partition, window_reverse
from .attention import attention
from .fused import FusedPath
from .linear import linear

MASKED = -100.0  # timm's value: exp(-100) underflows to 0 after softmax, yet stays finite in bf16

__all__ = ["MASKED", "WindowAttention", "cyclic_shift", "relative_position_index", "shift_mask",
           "window_partition", "window_reverse"]


def relative_position_index(window: int) -> torch.Tensor:
    """(N, N) row of the bias table for each (query, key) pair of a window, N = window²."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                        indexing="ij")).flatten(1)  # (2, N)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # (N, N, 2)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def shift_mask(res: int, window: int, shift: int) -> torch.Tensor:
    """(nW, N, N) additive mask: 0 within a region of the shifted map, ``MASKED`` across.

    After the roll, the last ``shift`` rows/columns hold tokens from the opposite edge; the
    three slices per axis label the 3x3 regions, and only same-region pairs were neighbours.
    """
    labels = torch.zeros(1, res, res, 1)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for region, (h, w) in enumerate(itertools.product(cuts, cuts)):
        labels[:, h, w, :] = region
    win = window_partition(labels, window).squeeze(-1)  # (nW, N)
    differ = win.unsqueeze(1) != win.unsqueeze(2)  # (nW, N, N)
    return torch.zeros(differ.shape).masked_fill(differ, MASKED)


class WindowAttention(FusedPath, nn.Module):
    """Multi-head attention within the windows of a (B, H, W, C) map rolled up-left by
    ``shift``, with the learned relative position bias (and the shift mask).

    Plain: roll, partition, SDPA over (B·nW, heads, N, D) with the bias (and mask) as a
    materialised additive mask, reverse, roll back. Fused (``kernels=window``):
    ``kernels.map_window_attention``, one Triton kernel each way straight from the qkv
    projection of the map, which finds each window's tokens by address (no roll, partition or
    reverse in memory) and adds bias and mask inside (windows up to ``MAX_TOKENS`` tokens)."""

    fused_kind, fused_triton, replaces_sdpa = "window", True, True
    attention_name = "window attention"

    def __init__(self, dim: int, heads: int, window: int, shift: int = 0):
        super().__init__()
        self.heads, self.window, self.shift, self.fused = heads, window, shift, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        self.register_buffer("relative_position_index", relative_position_index(window),
                             persistent=False)

    def use_fused(self, on: bool) -> list[str]:
        from ..kernels.window_attention import MAX_TOKENS  # Triton: imported only where used

        N = self.relative_position_index.shape[0]
        if on and N > MAX_TOKENS:
            return [f"window attention of {N} tokens kept on SDPA (Triton tile: ≤ {MAX_TOKENS})"]
        self.fused = on
        return ["window attention with bias, mask, shift and partition in one Triton kernel"]

    tiles: torch.Tensor | None = None
    """The bias and this layer's mask summed and padded once for the fused kernel
    (``freeze_bias``), or None: built from the table at every call."""

    def freeze_bias(self, mask: torch.Tensor | None) -> bool:
        """Build the fused forward's bias tiles once from the table as it is now and ``mask``
        (the one every call of this layer gets), for a model that is served, not trained: a
        call whose table needs no gradient, in the tiles' dtype and device, skips the per-call
        gather, sum and padding. Moving or casting the layer, loading a state dict or switching
        it to training drops the tiles (the table's path again); a table changed in place
        under ``no_grad`` is not seen by them: call this again. False where the layer is not
        on its fused path."""
        if not self.fused:
            return False
        from ..kernels.window_attention import window_bias_tiles

        table = self.relative_position_bias_table
        with torch.no_grad():
            self.tiles = window_bias_tiles(self.position_bias()[0],
                                           None if mask is None else mask.to(table.device),
                                           table.dtype)
        return True

    def _apply(self, fn, recurse=True):  # .to(), .half(), .cuda(): the tiles would not follow
        self.tiles = None
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True):
        if mode:
            self.tiles = None
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        self.tiles = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _frozen_tiles(self, qkv: torch.Tensor) -> torch.Tensor | None:
        """The tiles, where this call may read them: built, of qkv's dtype and device (not
        under an autocast of another dtype), and the table taking no gradient."""
        t = self.tiles
        if t is None or t.dtype != qkv.dtype or t.device != qkv.device:
            return None
        grad = torch.is_grad_enabled() and self.relative_position_bias_table.requires_grad
        return None if grad else t

    def position_bias(self) -> torch.Tensor:
        N = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        # Contiguous: SDPA's fused kernels need the mask's last dim at stride 1; the permuted
        # view (stride = heads) sent every unshifted block to the math kernel.
        return bias.view(N, N, self.heads).permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                proj_bias: bool = True) -> torch.Tensor:
        """``proj_bias=False`` leaves the output projection's bias out, for the caller to add."""
        if self.fused:  # x (B, H, W, C), mask (nW, N, N) for one image's windows
            from ..kernels.window_attention import (map_window_attention,
                                                    map_window_attention_tiles)

            qkv = self.qkv(x)
            tiles = self._frozen_tiles(qkv)
            if tiles is not None:  # bias and mask summed once (freeze_bias)
                out = map_window_attention_tiles(qkv, tiles, self.heads, self.window, self.shift)
            else:
                out = map_window_attention(qkv, self.position_bias()[0], mask, self.heads,
                                           self.window, self.shift)
            return linear(self.proj, out, bias=proj_bias)
        B, H, W, C = x.shape
        win = window_partition(cyclic_shift(x, self.shift) if self.shift else x, self.window)
        x = window_reverse(self._windows(win, mask, proj_bias), self.window, H, W)
        return cyclic_shift(x, -self.shift) if self.shift else x

    def _windows(self, x: torch.Tensor, mask: torch.Tensor | None,
                 proj_bias: bool = True) -> torch.Tensor:
        Bw, N, C = x.shape  # (B·nW, N, C)
        qkv = self.qkv(x).view(Bw, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.position_bias()
        if mask is not None:  # mask (nW, N, N)
            # Windows of one image repeat every nW along the batch, which no stride-0
            # broadcast expresses and fused SDPA kernels take 4-D inputs only, so the bias is
            # materialised: the size of the attention matrix eager attention keeps anyway.
            bias = (bias + mask.unsqueeze(1)).repeat(Bw // mask.shape[0], 1, 1, 1)
        out = attention(*qkv.unbind(0), bias=bias).transpose(1, 2).reshape(Bw, N, C)
        return linear(self.proj, out, bias=proj_bias)


def freeze_window_biases(model: nn.Module) -> int:
    """Every fused window attention of ``model``'s Swin blocks (a module with ``attn`` and its
    ``attn_mask``) builds its bias tiles once (``WindowAttention.freeze_bias``), for serving;
    how many did."""
    return sum(blk.attn.freeze_bias(blk.attn_mask) for blk in model.modules()
               if isinstance(getattr(blk, "attn", None), WindowAttention)
               and hasattr(blk, "attn_mask"))
