"""Converters for Hugging Face diffusers' Stable Diffusion classes: the UNet's and the VAE
encoder's ``ResnetBlock2D``, the spatial transformer (``Transformer2DModel``), its
``BasicTransformerBlock``, the ``Attention`` inside it, ``GEGLU`` and ``Upsample2D``.

- ``ResnetBlock2D`` → ``layers.unet.ResnetBlock`` (``kernels=groupnorm``: each GroupNorm +
  SiLU in two Triton passes each way; conv1 runs without its bias and norm2's kernels add it with
  the time embedding, so ``conv1 + bias + temb`` is never written).
- ``Transformer2DModel`` (SD v1's: GroupNorm, 1 × 1 conv in, blocks, 1 × 1 conv out) →
  ``layers.unet.SpatialTransformer``, its GroupNorm on the fused path too.
- ``BasicTransformerBlock`` → ``layers.sd_transformer.TransformerBlock`` (``kernels=layernorm``:
  norm2 and norm3 take the residual add before them and the attention output's bias).
- ``Attention`` (q, k, v without bias, ``AttnProcessor2_0``) →
  ``layers.sd_transformer.Attention``: the projections of one input as one GEMM, then
  fasttrain's attention.
- ``GEGLU`` → ``layers.mlp.GEGLU`` (``kernels=gelu``: bias and ``h · gelu(gate)`` in one kernel).
- ``Upsample2D`` (nearest 2×, then a 3 × 3 conv) → ``layers.unet.Upsample``, whose backward
  sums each 2 × 2 block of the gradient instead of scattering it with atomic adds.

Module names in diffusers and in fasttrain's SD are the same, so every parameter stays where it
was. Every converted class keeps the library class too (``isinstance``, ``set_attn_processor``,
``save_pretrained``) and hands a call it does not compute — an attention mask, cross-attention
kwargs, a processor set after the conversion, an IP adapter's (text, image) pair, an
``output_size``, gradient checkpointing, feed-forward chunking — to the library's forward on the
same module. What stays diffusers' own: the UNet's and the blocks' forward (so the
UNet's 22 time projections run as 22 GEMMs, not the one of fasttrain's own UNet), the VAE's
mid-block attention (its own GroupNorm and residual connection) and its downsamplers.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.mlp import GEGLU
from ..layers.norm import GroupNorm
from ..layers.sd_transformer import Attention, TransformerBlock
from ..layers.unet import ResnetBlock, SpatialTransformer, Upsample, norm2_bias_from
from .registry import Converter, class_path, library_forward, swap_keeping_library
from .timm_vit import layer_norm_unsupported, swap_layer_norm
from .torch_nn import dtype_unsupported

RESNET = ("diffusers.models.resnet.ResnetBlock2D",)
TRANSFORMER_2D = ("diffusers.models.transformers.transformer_2d.Transformer2DModel",)
BLOCK = ("diffusers.models.attention.BasicTransformerBlock",)
ATTENTION = ("diffusers.models.attention_processor.Attention",)
GEGLU_CLASS = ("diffusers.models.activations.GEGLU",)
UPSAMPLE = ("diffusers.models.upsampling.Upsample2D",)
PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")  # plain scaled dot-product attention
SAMPLE_SIDE, SAMPLE_TEXT = 4, 5  # a self-check's feature map side and text length


def _group_norm_unsupported(norm: nn.Module, where: str) -> str | None:
    if type(norm) is not nn.GroupNorm:
        return f"{where} is {type(norm).__name__}, not an nn.GroupNorm"
    if not norm.affine:
        return f"{where} has no weight and bias"
    return dtype_unsupported(norm.weight, norm.bias)


def _swap_group_norm(norm: nn.Module, silu: bool, x_bias_from: str | None = None) -> None:
    norm.__class__ = GroupNorm
    norm.silu, norm.fused, norm.x_bias_from = silu, False, x_bias_from


def _silu(m: nn.Module) -> bool:
    return type(m) is nn.SiLU


def _dropout_p(m: nn.Module) -> float:
    return m.p if isinstance(m, nn.Dropout) else 0.0


# ----------------------------------------------------------------------------- ResnetBlock2D

class DiffusersResnetBlock(ResnetBlock):
    """diffusers' ``ResnetBlock2D`` as fasttrain's ``ResnetBlock``, taking diffusers' call."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor | None = None, *args,
                **kwargs) -> torch.Tensor:
        if args or kwargs or (temb is not None and self.time_emb_proj is None):
            return self._library(input_tensor, temb, *args, **kwargs)
        return ResnetBlock.forward(self, input_tensor, temb)

    def _library(self, *args, **kwargs) -> torch.Tensor:
        """diffusers' forward, its norms plain GroupNorms for the call: the library applies its
        own SiLU after each, which the converted norms would otherwise apply once more."""
        norms = (self.norm1, self.norm2)
        saved = [(n.silu, n.fused) for n in norms]
        for n in norms:
            n.silu, n.fused = False, False
        try:
            return library_forward(self, *args, **kwargs)
        finally:
            for n, (silu, fused) in zip(norms, saved):
                n.silu, n.fused = silu, fused


def _conv3(conv: nn.Module) -> bool:
    return (type(conv) is nn.Conv2d and tuple(conv.kernel_size) == (3, 3)
            and tuple(conv.stride) == (1, 1) and tuple(conv.padding) == (1, 1)
            and tuple(conv.dilation) == (1, 1) and conv.groups == 1)


def resnet_unsupported(m: nn.Module) -> str | None:
    if m.time_embedding_norm != "default":
        return f"time_embedding_norm {m.time_embedding_norm!r} (fasttrain's block adds temb)"
    if m.up or m.down:
        return "a block that resamples inside (up or down) is not fasttrain's"
    if m.output_scale_factor != 1.0:
        return f"output_scale_factor {m.output_scale_factor} is not 1"
    if m.skip_time_act or not _silu(m.nonlinearity):
        return "its activation is not SiLU on both the features and the time embedding"
    if _dropout_p(m.dropout) > 0:
        return "dropout inside the block is not in the fused block"
    for where in ("norm1", "norm2"):
        if why := _group_norm_unsupported(getattr(m, where), where):
            return why
    if not (_conv3(m.conv1) and _conv3(m.conv2)) or m.conv2.out_channels != m.conv1.out_channels:
        return "conv1 and conv2 are not the 3 × 3 convolutions of one width"
    if m.time_emb_proj is not None and type(m.time_emb_proj) is not nn.Linear:
        return "time_emb_proj is not a plain nn.Linear"
    return None


def swap_resnet(m: nn.Module) -> None:
    _swap_group_norm(m.norm1, silu=True)
    _swap_group_norm(m.norm2, silu=True,
                     x_bias_from=norm2_bias_from(m.time_emb_proj is not None))
    swap_keeping_library(m, DiffusersResnetBlock)


def resnet_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    x = torch.randn(1, m.norm1.num_channels, SAMPLE_SIDE, SAMPLE_SIDE, generator=gen)
    temb = None
    if m.time_emb_proj is not None:
        temb = torch.randn(1, m.time_emb_proj.in_features, generator=gen)
    return (x, temb), {}


# ----------------------------------------------------------------------------- Attention

class DiffusersAttention(Attention):
    """diffusers' ``Attention`` as fasttrain's SD attention, taking diffusers' call (and the
    converted block's ``proj_bias``/``kv``); a mask or processor kwargs go to diffusers."""

    def forward(self, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, proj_bias: bool = True,
                kv=None, **cross_attention_kwargs) -> torch.Tensor:
        if not computes(self, hidden_states, encoder_hidden_states, attention_mask,
                        cross_attention_kwargs):
            if not proj_bias:  # the converted block checks first: never reached from it
                raise RuntimeError("a converted diffusers Attention without its output bias "
                                   "cannot hand its call to diffusers")
            return library_forward(self, hidden_states, encoder_hidden_states, attention_mask,
                                   **cross_attention_kwargs)
        return Attention.forward(self, hidden_states, encoder_hidden_states, proj_bias, kv)


def plain_processor(a: nn.Module) -> bool:
    """Whether the attention's processor (now: one set after the conversion counts too) is
    diffusers' plain scaled dot-product attention."""
    cls = type(getattr(a, "processor", None))
    return cls.__module__ == "diffusers.models.attention_processor" and cls.__name__ in PROCESSORS


def computes(a: nn.Module, x, context, mask, kwargs) -> bool:
    """Whether the converted attention computes this call: no mask, no processor kwargs, a plain
    processor, a text that is one tensor (an IP adapter hands a tuple), tokens (B, T, C)."""
    return (mask is None and not kwargs and plain_processor(a) and x.dim() == 3
            and (context is None or isinstance(context, torch.Tensor)))


def attention_unsupported(a: nn.Module) -> str | None:
    if not plain_processor(a):
        processor = type(getattr(a, "processor", None)).__name__
        return f"processor {processor} is not plain scaled dot-product attention"
    extras = [name for name in ("norm_q", "norm_k", "norm_cross", "add_q_proj", "add_k_proj",
                                "add_v_proj")
              if getattr(a, name, None) is not None]
    if extras:
        return f"its own {', '.join(extras)}"
    if a.residual_connection or a.rescale_output_factor != 1.0:
        return "a residual connection or output rescale inside the attention"
    if a.is_causal or a.only_cross_attention:
        return "causal or cross-only attention"
    layers = (a.to_q, a.to_k, a.to_v, a.to_out[0])
    if any(type(m) is not nn.Linear for m in layers):
        return "to_q, to_k, to_v or to_out.0 is not a plain nn.Linear"
    if any(m.bias is not None for m in layers[:3]):
        return "q, k and v with a bias (fasttrain's SD attention has none)"
    if len(a.to_out) > 1 and _dropout_p(a.to_out[1]) > 0:
        return "dropout after the output projection"
    dim = a.to_q.out_features
    if dim % a.heads or a.to_k.out_features != dim or a.to_v.out_features != dim:
        return f"{a.heads} heads do not split q, k and v of width {dim} evenly"
    if a.to_q.in_features != dim or a.to_out[0].in_features != dim:
        return f"an inner width {dim} other than the input's {a.to_q.in_features}"
    if abs(a.scale - (dim // a.heads) ** -0.5) > 1e-12:
        return f"scale {a.scale} is not 1/√(head dim)"
    return None


def transformer_attention(a: nn.Module) -> bool:
    """Whether an ``Attention`` is a transformer block's (the converter's concern) rather than
    a spatial self-attention with its own GroupNorm (the VAE's mid block), passed over."""
    return getattr(a, "group_norm", None) is None and getattr(a, "spatial_norm", None) is None


def swap_attention(a: nn.Module) -> None:
    swap_keeping_library(a, DiffusersAttention)


def attention_sample(a: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    x = torch.randn(1, 7, a.to_q.in_features, generator=gen)
    if a.is_cross_attention:
        return (x,), {"encoder_hidden_states": torch.randn(1, SAMPLE_TEXT, a.to_k.in_features,
                                                           generator=gen)}
    return (x,), {}


# ----------------------------------------------------------------------------- GEGLU

class DiffusersGEGLU(GEGLU):
    """diffusers' ``GEGLU`` (exact GELU) as fasttrain's, taking diffusers' call."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            return library_forward(self, hidden_states, *args, **kwargs)
        return GEGLU.forward(self, hidden_states)


def geglu_unsupported(g: nn.Module) -> str | None:
    if type(g.proj) is not nn.Linear or g.proj.bias is None:
        return "its projection is not a plain nn.Linear with a bias"
    return dtype_unsupported(g.proj.weight, g.proj.bias)


def swap_geglu(g: nn.Module) -> None:
    g.fused = False
    swap_keeping_library(g, DiffusersGEGLU)


def geglu_sample(g: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(1, 7, g.proj.in_features, generator=gen),), {}


# ----------------------------------------------------------------------------- blocks

class DiffusersTransformerBlock(TransformerBlock):
    """diffusers' ``BasicTransformerBlock`` (SD v1's layer-norm block) as fasttrain's."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, *args, **kwargs
                ) -> torch.Tensor:
        extras = args or any(_given(v) for v in kwargs.values())
        if (extras or encoder_hidden_states is None or self._chunk_size is not None
                or not all(computes(a, hidden_states, encoder_hidden_states, attention_mask, {})
                           for a in (self.attn1, self.attn2))):
            return library_forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                   *args, **kwargs)
        return TransformerBlock.forward(self, hidden_states, encoder_hidden_states)


def _given(value) -> bool:
    """An argument that asks for something: not None, and not an empty dict
    (``cross_attention_kwargs={}``)."""
    return value is not None and not (isinstance(value, dict) and not value)


def block_unsupported(m: nn.Module) -> str | None:
    if m.norm_type != "layer_norm" or m.pos_embed is not None:
        return f"norm_type {m.norm_type!r} or a positional embedding (SD v1's block has neither)"
    if m.only_cross_attention or m.double_self_attention or m.attn2 is None:
        return "not self-attention then cross-attention to the text"
    for where in ("norm1", "norm2", "norm3"):
        norm = getattr(m, where)
        why = layer_norm_unsupported(norm, where) or dtype_unsupported(norm.weight, norm.bias)
        if why:
            return why
    for where in ("attn1", "attn2"):
        attn = getattr(m, where)
        if class_path(attn) not in ATTENTION:
            return f"{where} is {type(attn).__name__}, not diffusers' Attention"
        if why := attention_unsupported(attn):
            return f"{where}: {why}"
    return None


def swap_block(m: nn.Module) -> None:
    for where in ("norm1", "norm2", "norm3"):
        swap_layer_norm(getattr(m, where), feeds_matmul=True)
    swap_attention(m.attn1)
    swap_attention(m.attn2)
    if class_path(m.ff.net[0]) in GEGLU_CLASS and geglu_unsupported(m.ff.net[0]) is None:
        swap_geglu(m.ff.net[0])
    swap_keeping_library(m, DiffusersTransformerBlock)


def block_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    text = torch.randn(1, SAMPLE_TEXT, m.attn2.to_k.in_features, generator=gen)
    return (torch.randn(1, 7, m.norm1.normalized_shape[0], generator=gen),), \
        {"encoder_hidden_states": text}


class DiffusersSpatialTransformer(SpatialTransformer):
    """diffusers' ``Transformer2DModel`` (continuous input, conv projections) as fasttrain's
    ``SpatialTransformer``, returning what diffusers returns."""

    def forward(self, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | None = None, *args, return_dict: bool = True,
                **kwargs):
        extras = args or any(_given(v) for v in kwargs.values())
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        if (extras or not isinstance(encoder_hidden_states, torch.Tensor) or checkpointing):
            return library_forward(self, hidden_states, encoder_hidden_states, *args,
                                   return_dict=return_dict, **kwargs)
        out = SpatialTransformer.forward(self, hidden_states, encoder_hidden_states)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def run_block(self, block: nn.Module, h: torch.Tensor, context: torch.Tensor, kv
                  ) -> torch.Tensor:
        return block(h, encoder_hidden_states=context)


def _conv1x1(conv: nn.Module, width: int) -> bool:
    return (type(conv) is nn.Conv2d and tuple(conv.kernel_size) == (1, 1)
            and conv.in_channels == conv.out_channels == width)


def transformer_2d_unsupported(m: nn.Module) -> str | None:
    if not m.is_input_continuous or m.use_linear_projection:
        return "not SD v1's layout (continuous input with 1 × 1 conv projections)"
    if why := _group_norm_unsupported(m.norm, "norm"):
        return why
    width = m.norm.num_channels
    if not (_conv1x1(m.proj_in, width) and _conv1x1(m.proj_out, width)):
        return "proj_in or proj_out is not a 1 × 1 convolution keeping the width"
    for i, block in enumerate(m.transformer_blocks):
        if class_path(block) not in BLOCK:
            return f"transformer_blocks.{i} is {type(block).__name__}"
        if why := block_unsupported(block):
            return f"transformer_blocks.{i}: {why}"
    return None


def swap_transformer_2d(m: nn.Module) -> None:
    _swap_group_norm(m.norm, silu=False)
    for block in m.transformer_blocks:
        swap_block(block)
    swap_keeping_library(m, DiffusersSpatialTransformer)


def transformer_2d_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    cross = m.transformer_blocks[0].attn2.to_k.in_features
    x = torch.randn(1, m.norm.num_channels, SAMPLE_SIDE, SAMPLE_SIDE, generator=gen)
    return (x,), {"encoder_hidden_states": torch.randn(1, SAMPLE_TEXT, cross, generator=gen),
                  "return_dict": False}


# ----------------------------------------------------------------------------- Upsample2D

class DiffusersUpsample(Upsample):
    """diffusers' ``Upsample2D`` (nearest 2×, 3 × 3 conv) as fasttrain's ``Upsample``; an
    ``output_size`` (a latent that does not halve evenly) goes to diffusers."""

    def forward(self, hidden_states: torch.Tensor, output_size=None, *args, **kwargs):
        if output_size is not None or args or kwargs:
            return library_forward(self, hidden_states, output_size, *args, **kwargs)
        return Upsample.forward(self, hidden_states)


def upsample_unsupported(m: nn.Module) -> str | None:
    if not m.use_conv or m.use_conv_transpose or not m.interpolate or m.norm is not None:
        return "not nearest 2× followed by a convolution"
    if m.name != "conv" or not _conv3(m.conv):
        return "its convolution is not a 3 × 3 conv named conv"
    return None


def swap_upsample(m: nn.Module) -> None:
    swap_keeping_library(m, DiffusersUpsample)


def upsample_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(1, m.channels, SAMPLE_SIDE, SAMPLE_SIDE, generator=gen),), {}


CONVERTERS = (
    Converter("diffusers Transformer2DModel", TRANSFORMER_2D,
              "fasttrain spatial transformer: GroupNorm kernels, fused LayerNorms with the "
              "residual adds, stacked q/k/v GEMMs, fasttrain's attention, GEGLU kernel",
              transformer_2d_unsupported, swap_transformer_2d, transformer_2d_sample),
    Converter("diffusers BasicTransformerBlock", BLOCK,
              "fasttrain SD transformer block (fused LayerNorms with the residual adds)",
              block_unsupported, swap_block, block_sample),
    Converter("diffusers Attention", ATTENTION,
              "fasttrain SD attention (stacked q/k/v GEMM, fasttrain's attention)",
              attention_unsupported, swap_attention, attention_sample,
              candidate=transformer_attention),
    Converter("diffusers ResnetBlock2D", RESNET,
              "fasttrain ResNet block (GroupNorm + SiLU kernels, conv1's bias and the time "
              "embedding added inside norm2's kernels)",
              resnet_unsupported, swap_resnet, resnet_sample),
    Converter("diffusers GEGLU", GEGLU_CLASS, "fasttrain GEGLU (kernels=gelu)",
              geglu_unsupported, swap_geglu, geglu_sample),
    Converter("diffusers Upsample2D", UPSAMPLE,
              "fasttrain upsampler (a 2 × 2 block sum for the backward, no atomic adds)",
              upsample_unsupported, swap_upsample, upsample_sample),
)
