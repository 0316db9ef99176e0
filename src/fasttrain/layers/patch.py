"""Patch embedding: a convolution whose kernel equals its stride, or the same maths as one GEMM.

ViT and Swin cut the image into p×p patches and project each with a ``Conv2d(3, D, p, p)``.
With kernel = stride the windows do not overlap, so the convolution is exactly a reshape of the
image into (patches, 3·p·p) rows times the flattened kernel: one GEMM. cuDNN's kernels for this
odd convolution — three input channels, stride 16 — are slow, its weight gradient above all
(ViT-B/16, H200: 3.3 ms of a 38 ms step, profile-vit-base-20261121-061813), while the GEMM of
25,088 × 768 × 768 takes a fraction of that. The kernels switch turns the GEMM path on
(``use_fused``); parameters and their names stay the convolution's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath


class PatchEmbed(FusedPath, nn.Conv2d):
    """``Conv2d(channels, dim, patch, stride=patch)`` with :meth:`tokens` → (B, H/p, W/p, dim)."""

    fused_kind = "patch"
    contiguous_out = False
    """Whether ``forward`` on the GEMM path returns a contiguous (B, dim, H/p, W/p), as the
    convolution does for a contiguous input: for a caller whose use of it is not known (a
    plain model's ``.view``); fasttrain's and timm's callers take the permuted view."""

    def __init__(self, channels: int, dim: int, patch: int):
        super().__init__(channels, dim, patch, patch)
        self.patch, self.as_gemm = patch, False

    def use_fused(self, on: bool) -> list[str]:
        self.as_gemm = on
        return [f"{self.patch}x{self.patch} patch embedding as one GEMM"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution's (B, dim, H/p, W/p); on the GEMM path a permuted view of the GEMM's
        rows, so a caller that flattens it to tokens (timm's PatchEmbed) copies nothing. As the
        convolution, it leaves out the last rows and columns of an image that does not tile."""
        if not self.as_gemm:
            return super().forward(x)
        if x.dim() == 3:  # unbatched (C, H, W), as nn.Conv2d takes it
            return self.forward(x[None])[0]
        p = self.patch
        if x.shape[-2] % p or x.shape[-1] % p:  # as the convolution: the rest is not read
            x = x[..., :x.shape[-2] // p * p, :x.shape[-1] // p * p]
        out = self.tokens(x).permute(0, 3, 1, 2)  # channels-last, as the convolution's of an
        if self.contiguous_out and (  # NHWC input; NCHW for an NCHW one
                x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last)):
            return out.contiguous()
        return out

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images → (B, H/p, W/p, dim) patch embeddings."""
        if not self.as_gemm:
            return super().forward(x).permute(0, 2, 3, 1)
        B, C, H, W = x.shape
        p = self.patch
        if H % p or W % p:
            raise ValueError(f"image of {H}x{W} does not tile by {p}x{p} patches")
        rows = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        rows = rows.reshape(B * (H // p) * (W // p), C * p * p)  # (c, kh, kw) as the kernel
        out = F.linear(rows, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.view(B, H // p, W // p, self.out_channels)
