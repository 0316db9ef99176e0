"""Converters for plain ``torch.nn`` layers, for a model written with torch.nn alone (no timm,
no transformers): the layers such a model builds its blocks from.

- ``nn.LayerNorm`` → ``layers.norm.LayerNorm`` (``kernels=layernorm``: the norm in one Triton
  pass each way, its weight and bias gradients summed in the backward's pass).
- ``nn.RMSNorm`` → ``layers.norm.RMSNorm`` (``kernels=rmsnorm``, the same without the mean;
  ``eps=None`` keeps its meaning: fp32's machine epsilon, as torch computes it).
- ``nn.Sequential`` with a Linear → GELU pair (``nn.Sequential(nn.Linear, nn.GELU(),
  nn.Linear)``, the usual plain MLP) → ``layers.mlp.GeluSequential`` (``kernels=gelu``: each
  pair's matmul without its bias, then bias + GELU, erf or tanh, in one kernel each way); the
  same children under the same indices. A Sequential without such a pair is not this
  converter's and is passed over without a word.
- ``nn.MultiheadAttention`` → ``layers.attention.MultiheadSelfAttention`` (``kernels=attention``:
  its self-attention calls, ``mha(x, x, x, need_weights=False)`` without masks, from the packed
  projection in one Triton kernel each way); every other call runs its own forward.
- ``nn.Conv2d`` that cuts an image into patches (fewer than 8 input channels, a square kernel
  equal to its stride: a ViT's or Swin's patch projection, a ConvNeXt stem) →
  ``layers.patch.PatchEmbed`` (``kernels=patch``: the convolution as one GEMM, whose weight
  gradient is a fraction of cuDNN's for this shape). Other convolutions are not this
  converter's and are passed over without a word.

Attention written with ``F.scaled_dot_product_attention`` in a module of the user's own has no
class to convert: ``kernels=attention`` routes those calls instead (``layers/sdpa_route.py``).
The swaps keep every parameter (names, shapes, dtypes, objects); the norms' and the
Sequential's plain paths are torch's own forward, the attention's plain path too.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import MultiheadSelfAttention
from ..layers.mlp import GeluSequential, gelu_pairs
from ..layers.norm import LayerNorm, RMSNorm
from ..layers.patch import PatchEmbed
from .registry import SAMPLE_TOKENS, Converter

LAYER_NORM = ("torch.nn.modules.normalization.LayerNorm",)
RMS_NORM = ("torch.nn.modules.normalization.RMSNorm",)
SEQUENTIAL = ("torch.nn.modules.container.Sequential",)
MULTIHEAD_ATTENTION = ("torch.nn.modules.activation.MultiheadAttention",)
CONV2D = ("torch.nn.modules.conv.Conv2d",)
IMAGE_CHANNELS = 8  # fewer input channels than this: the convolution reads an image
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton kernels take


def dtype_unsupported(*params: torch.Tensor | None) -> str | None:
    bad = sorted({str(p.dtype) for p in params if p is not None and p.dtype not in KERNEL_DTYPES})
    return f"{', '.join(bad)} parameters (the kernels take fp32, bf16, fp16)" if bad else None


# ----------------------------------------------------------------------------- norms

def norm_unsupported(m: nn.Module) -> str | None:
    """What the fused norms need: one normalized (last) dim, a weight (LayerNorm's bias may be
    absent), parameters in a dtype the kernels take."""
    if len(m.normalized_shape) != 1:
        return (f"normalized over the last {len(m.normalized_shape)} dims; the fused norm "
                "normalizes the last one")
    if m.weight is None:
        return "no elementwise affine: the fused norm's kernels take a weight"
    return dtype_unsupported(m.weight, getattr(m, "bias", None))


def swap_layer_norm(m: nn.Module) -> None:
    m.__class__ = LayerNorm
    m.feeds_matmul, m.fused = False, False  # its output in the dtype the plain path gives


def swap_rms_norm(m: nn.Module) -> None:
    m.__class__ = RMSNorm
    m.feeds_matmul, m.fused = False, False


def norm_sample(m: nn.Module, gen: torch.Generator) -> tuple:
    return (torch.randn(2, SAMPLE_TOKENS, m.normalized_shape[0], generator=gen),), {}


# ----------------------------------------------------------------------------- Sequential

def has_gelu_pair(m: nn.Module) -> bool:
    return bool(gelu_pairs(list(m)))


def sequential_unsupported(m: nn.Module) -> str | None:
    mods = list(m)
    pairs = gelu_pairs(mods)
    held = [mods[i] for i in pairs if not isinstance(getattr(mods[i], "weight", None),
                                                      torch.Tensor)]
    if held:  # the inference path's 8-bit layers hold codes and scales, not a weight
        return (f"its {type(held[0]).__name__} holds no weight (quantized): convert the model "
                "before quantizing it")
    return dtype_unsupported(*(p for i in pairs for p in (mods[i].weight, mods[i].bias)))


def swap_sequential(m: nn.Module) -> None:
    m.__class__ = GeluSequential
    m.fused = False


def sequential_sample(m: nn.Module, gen: torch.Generator) -> tuple | None:
    """A sequence of the first child's input width, where that is known (a Linear or a norm
    over the last dim first); None else (no self-check: the plain path is nn.Sequential's)."""
    first = m[0]
    if isinstance(first, nn.Linear):
        width = first.in_features
    elif isinstance(first, (nn.LayerNorm, nn.RMSNorm)) and len(first.normalized_shape) == 1:
        width = first.normalized_shape[0]
    else:
        return None
    return (torch.randn(2, SAMPLE_TOKENS, width, generator=gen),), {}


# ----------------------------------------------------------------------------- attention

def mha_unsupported(m: nn.Module) -> str | None:
    if not m._qkv_same_embed_dim:
        return "kdim or vdim differs from embed_dim: separate q, k, v projections"
    if m.bias_k is not None or m.bias_v is not None:
        return "add_bias_kv is not in the fused attention"
    if m.add_zero_attn:
        return "add_zero_attn is not in the fused attention"
    if m.dropout > 0:
        return f"attention dropout {m.dropout} is not in the fused attention"
    return dtype_unsupported(m.in_proj_weight)


def swap_mha(m: nn.Module) -> None:
    m.__class__ = MultiheadSelfAttention
    m.fused = False


def mha_sample(m: nn.Module, gen: torch.Generator) -> tuple:
    shape = (2, SAMPLE_TOKENS, m.embed_dim) if m.batch_first else (SAMPLE_TOKENS, 2, m.embed_dim)
    x = torch.randn(*shape, generator=gen)
    return (x, x, x), {"need_weights": False}


# ----------------------------------------------------------------------------- patch projection

def is_patch_projection(m: nn.Module) -> bool:
    """A convolution over an image (few channels) whose square kernel equals its stride."""
    k = tuple(m.kernel_size)
    return (m.in_channels < IMAGE_CHANNELS and k[0] == k[1] >= 2
            and tuple(m.stride) == k)


def patch_unsupported(m: nn.Module) -> str | None:
    padding = (0, 0) if m.padding == "valid" else m.padding
    if padding == "same" or tuple(padding) != (0, 0):
        return f"padding {m.padding}: the GEMM path takes unpadded patches"
    if tuple(m.dilation) != (1, 1) or m.groups != 1:
        return "a dilated or grouped convolution is not one GEMM over patches"
    return dtype_unsupported(m.weight, m.bias)


def swap_patch(m: nn.Module) -> None:
    m.__class__ = PatchEmbed
    m.patch, m.as_gemm, m.contiguous_out = m.kernel_size[0], False, True


def patch_sample(m: nn.Module, gen: torch.Generator) -> tuple:
    p = m.kernel_size[0]
    return (torch.randn(2, m.in_channels, 2 * p, 3 * p, generator=gen),), {}


CONVERTERS = (
    Converter("torch LayerNorm", LAYER_NORM, "fasttrain LayerNorm (kernels=layernorm)",
              norm_unsupported, swap_layer_norm, norm_sample),
    Converter("torch RMSNorm", RMS_NORM, "fasttrain RMSNorm (kernels=rmsnorm)",
              norm_unsupported, swap_rms_norm, norm_sample),
    Converter("torch Sequential Linear → GELU", SEQUENTIAL,
              "nn.Sequential whose Linear → GELU pairs run bias + GELU fused (kernels=gelu)",
              sequential_unsupported, swap_sequential, sequential_sample, has_gelu_pair),
    Converter("torch MultiheadAttention", MULTIHEAD_ATTENTION,
              "multi-head self-attention on the Triton kernel (kernels=attention)",
              mha_unsupported, swap_mha, mha_sample),
    Converter("torch Conv2d patch projection", CONV2D,
              "the patch projection as one GEMM (kernels=patch)",
              patch_unsupported, swap_patch, patch_sample, is_patch_projection),
)
