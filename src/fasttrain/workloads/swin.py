"""Swin Transformer v1 image classification (the shapes of timm's swin_base_patch4_window7_224).

Attention runs inside non-overlapping windows with a learned relative position bias; every odd
block first rolls the map by half a window (a cyclic shift) so information crosses window
borders, and masks the token pairs that the roll brought together from opposite edges. The
window partition, its reverse and the shift (``layers/windows.py``) are what the fused window
kernel does by address instead. Sizes: ``base`` is Swin-B, ``large`` Swin-L; ``variant='t'`` (or ``'s'``,
``'b'``, ``'l'``) picks that architecture whatever the size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.blocks import Branch, block_fp32_params, pre_norm_block, run_blocks
from ..layers.mlp import Mlp
from ..layers.norm import LayerNorm
from ..layers.patch import PatchEmbed
from ..layers.windows import WindowAttention, shift_mask
from .base import Workload
from .data import ImageFiles, classification_images, normalize_images


@dataclass(frozen=True)
class SwinConfig:
    image: int = 224
    patch: int = 4
    dim: int = 128  # embedding width of stage 1; doubles at every patch merging
    depths: tuple[int, ...] = (2, 2, 18, 2)
    heads: tuple[int, ...] = (4, 8, 16, 32)
    window: int = 7
    mlp_ratio: int = 4
    classes: int = 1000


CONFIGS = {
    "tiny": SwinConfig(image=32, patch=2, dim=32, depths=(2, 2), heads=(2, 4), window=4,
                       classes=10),
    "base": SwinConfig(),
    "large": SwinConfig(dim=192, heads=(6, 12, 24, 48)),
}
VARIANTS = {
    "t": SwinConfig(dim=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24)),
    "s": SwinConfig(dim=96, heads=(3, 6, 12, 24)),
    "b": CONFIGS["base"],
    "l": CONFIGS["large"],
}


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, res: int, window: int, shift: int, mlp_ratio: int):
        super().__init__()
        if res <= window:  # one window covers the map: nothing to shift across (as timm)
            window, shift = res, 0
        self.norm1 = LayerNorm(dim, feeds_matmul=True)
        self.attn = WindowAttention(dim, heads, window, shift)
        self.norm2 = LayerNorm(dim, feeds_matmul=True)
        self.mlp = Mlp(dim, dim * mlp_ratio)
        mask = shift_mask(res, window, shift) if shift else None
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor, branch: Branch = None, hand_on: bool = False
                ) -> tuple[torch.Tensor, Branch]:
        """x: the residual stream (B, H, W, C); ``branch``, ``hand_on``: see ``run_blocks``."""
        return pre_norm_block(self, x, branch, hand_on, self.attn_mask)

    def fp32_params(self) -> list[nn.Parameter]:
        return block_fp32_params(self)


class PatchMerging(nn.Module):
    """(B, H, W, C) → (B, H/2, W/2, 2C): each 2x2 neighbourhood concatenated, then projected."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        # timm's channel order: (0,0), (1,0), (0,1), (1,1) offsets, so its weights load as-is
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, in_dim: int, dim: int, depth: int, heads: int, res: int, cfg: SwinConfig):
        super().__init__()
        self.downsample = PatchMerging(in_dim) if in_dim != dim else nn.Identity()
        self.blocks = nn.ModuleList(
            SwinBlock(dim, heads, res, cfg.window, cfg.window // 2 if i % 2 else 0, cfg.mlp_ratio)
            for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, self.downsample(x))


class Swin(nn.Module):
    def __init__(self, cfg: SwinConfig):
        super().__init__()
        self.cfg = cfg
        self.channels_last = False  # set by the channels_last technique
        self.stream_dtype: torch.dtype | None = None  # set by the stream_dtype technique
        self.patch_embed = PatchEmbed(3, cfg.dim, cfg.patch)
        self.patch_norm = nn.LayerNorm(cfg.dim)
        res, dim, stages = cfg.image // cfg.patch, cfg.dim, []
        for i, (depth, heads) in enumerate(zip(cfg.depths, cfg.heads)):
            in_dim, res, dim = dim, (res // 2 if i else res), (dim * 2 if i else dim)
            if res % cfg.window and res > cfg.window:
                raise ValueError(f"stage {i + 1}: {res}x{res} tokens do not tile by "
                                 f"{cfg.window}x{cfg.window} windows")
            stages.append(SwinStage(in_dim, dim, depth, heads, res, cfg))
        # a Sequential, not a ModuleList, so repeated_blocks() finds the blocks, not the stages
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.classes)
        self.apply(_init_weights)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        # the model's own dtype (bf16 with bf16-true), which its norms keep: the matmul
        # weights are bf16 also under bf16-mixed with master weights
        x = normalize_images(images, self.norm.weight.dtype, self.channels_last)
        x = self.patch_norm(self.patch_embed.tokens(x))  # (B, H, W, C)
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        x = self.norm(self.stages(x))
        return x.mean(dim=(1, 2))  # (B, C)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(images))
        return F.cross_entropy(logits.float(), labels, reduction="sum")


def _init_weights(m: nn.Module) -> None:
    """timm's Swin init; the patch-embedding conv keeps PyTorch's default, as in timm."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, WindowAttention):
        nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)


class SwinWorkload(Workload):
    name, unit, conv = "swin", "img", True
    # 49-token windows with an additive bias: compile's decomposed math attention (batched
    # matmuls + one fused bias/mask/softmax kernel) may beat the fused SDPA kernels, which are
    # built for long sequences; the fast preset search measures both
    attention_candidates = ("math",)

    def __init__(self, size: str, seed: int, data: str | None, variant: str | None):
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
        self.size, self.seed, self.data_dir, self.variant = size, seed, data, variant
        self.cfg = VARIANTS[variant] if variant else CONFIGS[size]
        self.default_batch = {"tiny": 8, "base": 64, "large": 32}[size]

    def build_model(self) -> nn.Module:
        return Swin(self.cfg)

    def dataset(self) -> ImageFiles:
        return classification_images(self.data_dir, self.cfg.image, self.cfg.classes,
                                     tiny=self.size == "tiny", seed=self.seed)

    def describe(self) -> dict:
        return {**super().describe(), **({"variant": self.variant} if self.variant else {})}


def make(size: str = "tiny", seed: int = 0, data: str | None = None,
         variant: str | None = None) -> SwinWorkload:
    return SwinWorkload(size, seed, data, variant)
