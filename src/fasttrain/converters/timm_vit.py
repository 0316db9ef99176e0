"""Converters for timm's Vision Transformer (``timm.models.vision_transformer``) and the layers
timm's other models share with it (``Attention``, ``Mlp``, ``PatchEmbed``, their LayerNorms).

- ``Block`` (pre-norm: ``x + attn(norm1(x))``, ``+ mlp(norm2(·))``) → a fasttrain pre-norm block
  (``layers.blocks.pre_norm_block``): with ``kernels=layernorm`` the residual adds and the
  projections' biases move into the norms' kernels, and a model's ``blocks`` stack runs as one
  chain, each block's MLP branch added inside the next block's first norm.
- ``Attention`` → ``layers.attention.SelfAttention`` (``kernels=attention``: one Triton kernel
  each way straight from the qkv projection's layout).
- ``Mlp`` (fc1 → GELU → fc2) → ``layers.mlp.Mlp`` (``kernels=gelu``: fc1's bias and the GELU in
  one kernel each way).
- ``PatchEmbed``'s convolution (kernel = stride) → ``layers.patch.PatchEmbed`` (``kernels=patch``:
  the convolution as one GEMM).
- the blocks' LayerNorms → ``layers.norm.LayerNorm`` (``kernels=layernorm``).

Layer scale and stochastic depth are applied to the branches as timm applies them (the branches
then keep their biases). What these layers do not compute is refused with its reason and left to
timm: dropout, qk-norm, gated or narrowed attention, another activation, a norm inside the MLP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import SelfAttention
from ..layers.linear import linear
from ..layers.blocks import Branch, ChainLink, Post, block_fp32_params, pre_norm_block
from ..layers.mlp import Mlp
from ..layers.norm import LayerNorm
from ..layers.patch import PatchEmbed
from .registry import Converter, class_path, sequence_sample

ATTENTION = ("timm.layers.attention.Attention", "timm.models.vision_transformer.Attention")
MLP = ("timm.layers.mlp.Mlp",)
BLOCK = ("timm.models.vision_transformer.Block",)
PATCH_EMBED = ("timm.layers.patch_embed.PatchEmbed",)
LAYER_NORMS = ("timm.layers.norm.LayerNorm", "torch.nn.modules.normalization.LayerNorm")


# ----------------------------------------------------------------------------- shared checks

def is_identity(module: nn.Module | None) -> bool:
    return module is None or type(module) is nn.Identity


def dropout_p(*modules: nn.Module | None) -> float:
    """The largest dropout probability among ``modules`` (Dropout layers; others count 0)."""
    return max((m.p for m in modules if isinstance(m, nn.Dropout)), default=0.0)


def plain_linear(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def layer_norm_unsupported(norm: nn.Module, where: str) -> str | None:
    if class_path(norm) not in LAYER_NORMS:
        return f"{where} is {type(norm).__name__}, not a LayerNorm"
    if len(norm.normalized_shape) != 1 or norm.weight is None or norm.bias is None:
        return f"{where} is not a LayerNorm over the last dim with weight and bias"
    return None


def swap_layer_norm(norm: nn.Module, feeds_matmul: bool) -> None:
    norm.__class__ = LayerNorm
    norm.feeds_matmul, norm.fused = feeds_matmul, False


# ----------------------------------------------------------------------------- Attention

class TimmAttention(SelfAttention):
    """timm's ``Attention`` as ``SelfAttention``, taking timm's arguments: a mask or causal
    attention (which the fused kernel does not take) runs through SDPA."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False, proj_bias: bool = True) -> torch.Tensor:
        if attn_mask is None and not is_causal:
            return super().forward(x, None, proj_bias)
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        out = out.transpose(1, 2).reshape(B, T, C)
        return linear(self.proj, out, bias=proj_bias)


def attention_unsupported(m: nn.Module) -> str | None:
    if not plain_linear(m.qkv, m.proj):
        return "qkv or proj is not a plain nn.Linear"
    if not all(is_identity(getattr(m, n, None)) for n in ("q_norm", "k_norm", "norm")):
        return "qk-norm or scale-norm is not in the fused attention"
    if getattr(m, "gate", None) is not None:
        return "gated attention is not in the fused attention"
    if dropout_p(m.attn_drop, m.proj_drop) > 0:
        return "attention dropout is not in the fused attention"
    return qkv_unsupported(m)


def qkv_unsupported(m: nn.Module) -> str | None:
    """What fasttrain's attention layers assume of timm's ``qkv``/``proj`` pair: attention as wide
    as the model, whole heads, the usual scale."""
    dim, heads = m.qkv.in_features, m.num_heads
    if m.qkv.out_features != 3 * dim or m.proj.in_features != dim or dim % heads:
        return f"attention width {m.qkv.out_features // 3} differs from the model width {dim}"
    if abs(m.scale - (dim // heads) ** -0.5) > 1e-12:
        return f"attention scale {m.scale} is not head_dim^-1/2"
    return None


def swap_attention(m: nn.Module) -> None:
    m.heads, m.batch_second, m.fused = m.num_heads, False, False
    m.__class__ = TimmAttention


# ----------------------------------------------------------------------------- Mlp

def mlp_unsupported(m: nn.Module) -> str | None:
    if not plain_linear(m.fc1, m.fc2):
        return "fc1 or fc2 is not a plain nn.Linear (a 1x1 convolution MLP)"
    if type(m.act) is not nn.GELU:
        return f"activation {type(m.act).__name__} is not GELU"
    if not is_identity(m.norm):
        return "a norm inside the MLP is not in the fused path"
    if dropout_p(m.drop1, m.drop2) > 0:
        return "MLP dropout is not in the fused path"
    return None


def swap_mlp(m: nn.Module) -> None:
    m.approximate, m.fused = m.act.approximate, False
    m.__class__ = Mlp


# ----------------------------------------------------------------------------- Block

class TimmBlock(ChainLink, nn.Module):
    """timm's ViT ``Block`` as a fasttrain pre-norm block (``pre_norm_block``), with timm's layer
    scale and stochastic depth applied to the branches where the model has them; with a mask
    or causal attention it runs as timm's does."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False, *, branch: Branch = None, hand_on: bool = False,
                chained: bool = False):
        if attn_mask is not None or is_causal:
            x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask,
                                                       is_causal=is_causal)))
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        x, branch = pre_norm_block(self, x, branch, hand_on, post=self.post())
        return (x, branch) if chained else x

    def post(self) -> Post:
        """Layer scale then stochastic depth on each branch (timm's order), or None."""
        if all(is_identity(m) for m in (self.ls1, self.ls2, self.drop_path1, self.drop_path2)):
            return None
        return (lambda a: self.drop_path1(self.ls1(a)), lambda m: self.drop_path2(self.ls2(m)))

    def fp32_params(self) -> list[nn.Parameter]:
        return block_fp32_params(self, self.post())


def norms_and_mlp_unsupported(m: nn.Module) -> str | None:
    """What a timm pre-norm block (ViT's, Swin's) needs of its ``norm1``, ``norm2`` and ``mlp``."""
    for where in ("norm1", "norm2"):
        if why := layer_norm_unsupported(getattr(m, where), where):
            return why
    if class_path(m.mlp) not in MLP:
        return f"MLP {type(m.mlp).__name__} is not timm's Mlp"
    return mlp_unsupported(m.mlp)


def swap_norms_and_mlp(m: nn.Module) -> None:
    swap_layer_norm(m.norm1, feeds_matmul=True)
    swap_layer_norm(m.norm2, feeds_matmul=True)
    swap_mlp(m.mlp)


def block_unsupported(m: nn.Module) -> str | None:
    if class_path(m.attn) not in ATTENTION:
        return f"attention {type(m.attn).__name__} is not timm's Attention"
    return attention_unsupported(m.attn) or norms_and_mlp_unsupported(m)


def swap_block(m: nn.Module) -> None:
    swap_norms_and_mlp(m)
    swap_attention(m.attn)
    m.__class__ = TimmBlock


# ----------------------------------------------------------------------------- PatchEmbed

def patch_embed_unsupported(m: nn.Module) -> str | None:
    conv = m.proj
    if type(conv) is not nn.Conv2d:
        return f"projection {type(conv).__name__} is not a plain nn.Conv2d"
    k = conv.kernel_size
    if (k[0] != k[1] or tuple(conv.stride) != tuple(k) or tuple(conv.padding) != (0, 0)
            or tuple(conv.dilation) != (1, 1) or conv.groups != 1
            or conv.padding_mode != "zeros"):
        return "the convolution is not a square kernel = stride patch projection"
    if getattr(m, "dynamic_img_pad", False):
        return "dynamic image padding is not in the GEMM path"
    return None


def swap_patch_embed(m: nn.Module) -> None:
    conv = m.proj
    conv.__class__ = PatchEmbed
    conv.patch, conv.as_gemm = conv.kernel_size[0], False


def patch_sample(m: nn.Module, gen: torch.Generator) -> tuple:
    p = m.proj.kernel_size[0]
    h, w = getattr(m, "img_size", None) or (2 * p, 2 * p)
    return (torch.randn(1, m.proj.in_channels, h, w, generator=gen),), {}


CONVERTERS = (
    Converter("timm ViT Block", BLOCK, "fasttrain pre-norm block (fused norms with the residual "
              "adds; attention, GELU and LayerNorm kernels)", block_unsupported, swap_block,
              sequence_sample(lambda m: m.norm1.normalized_shape[0])),
    Converter("timm Attention", ATTENTION, "fasttrain self-attention (kernels=attention)",
              attention_unsupported, swap_attention,
              sequence_sample(lambda m: m.qkv.in_features)),
    Converter("timm Mlp", MLP, "fasttrain MLP (kernels=gelu)", mlp_unsupported, swap_mlp,
              sequence_sample(lambda m: m.fc1.in_features)),
    Converter("timm PatchEmbed", PATCH_EMBED, "patch projection as one GEMM (kernels=patch)",
              patch_embed_unsupported, swap_patch_embed, patch_sample),
)
