"""Converters: public model classes (timm's ViT and Swin blocks, attention, MLP, patch
embedding; transformers' Llama, Mistral and Qwen2 decoder layers, RMSNorm, MLP, model and
causal-LM loss; diffusers' SD ResNet blocks, spatial transformers, their transformer blocks,
attention, GEGLU and upsamplers; torch.nn's LayerNorm, RMSNorm, MultiheadAttention and Linear → GELU
``nn.Sequential``s of a model of your own) turned in place into fasttrain layers that compute
the same function and carry the fused paths, so the ``kernels``, ``stream_dtype`` and
``master_weights`` switches reach a model you did not write.

    report = fasttrain.convert(model, kernels="fused")   # in place; returns what it did
    print(report.summary())       # "timm ViT Block ×12; timm PatchEmbed ×1; …; bias + GELU …"

Parameter names, shapes, dtypes and objects are unchanged: a state dict loads into the converted
model and back into the library's, and an optimizer built before still holds the parameters.
"""
from __future__ import annotations

from .apply import (ConvertReport, chain_stacks, convert, convertible, nothing_converted,
                    self_check)
from .registry import Converter, class_path, list_converters, registry

__all__ = ["ConvertReport", "Converter", "chain_stacks", "class_path", "convert", "convertible",
           "list_converters", "nothing_converted", "registry", "self_check"]
