"""Swin's window bookkeeping on a (B, H, W, C) token map, in plain PyTorch: the cyclic shift and
the partition into windows, and their inverses. The window-attention kernel's reference
(``kernels/window_attention.py``) composes them; the window-attention layer's plain path
(``layers/windows.py``) runs them."""
from __future__ import annotations

import torch


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) → (B·nW, window², C); windows row-major within each image."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, C)


def window_reverse(windows: torch.Tensor, window: int, H: int, W: int) -> torch.Tensor:
    """(B·nW, window², C) → (B, H, W, C): the inverse of :func:`window_partition`."""
    C = windows.shape[-1]
    x = windows.view(-1, H // window, W // window, window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, C)


def cyclic_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Roll (B, H, W, C) up-left by ``shift`` tokens; ``-shift`` undoes it."""
    return torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
