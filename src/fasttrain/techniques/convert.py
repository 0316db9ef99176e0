"""Public model classes converted in place to fasttrain's layers (``convert=true``).

A timm ViT or Swin trains its own ``Attention``, ``Mlp``, ``Block`` and ``PatchEmbed`` classes,
a transformers Llama its ``LlamaDecoderLayer``, ``LlamaRMSNorm`` and ``LlamaMLP``: none has a
fused path, so ``kernels``, ``stream_dtype`` and ``master_weights`` would find
nothing to switch. The converters (``fasttrain.convert``) swap each module they recognise for a
fasttrain layer that computes the same function and carries the fused path, keeping its
parameters (names, shapes, dtypes, objects). Each swap is checked on a random input first; a
module whose configuration the layer does not compute stays as it was, with the reason in the
run's warnings. Runs first of the model surgery: before the FLOP probe (the converted plain
path computes the same FLOPs), the stream cast and the kernels switch, which look for the
fasttrain layers. Numerics: the same maths in the same order on the plain path.
"""
from __future__ import annotations

from ..converters import convert, nothing_converted
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str | None:
    report = convert(state.model)
    for line in report.skipped_lines():
        state.warn("convert", line)
    if not report:
        state.idle("convert", nothing_converted(state.model, report))
        return None
    return report.summary()


TECHNIQUE = Technique(
    name="convert", phase=Phase.CONVERT,
    summary="public model classes (timm ViT, Swin; transformers Llama, Mistral, Qwen2; diffusers "
            "SD blocks) swapped for fasttrain layers with fused paths",
    changes_numerics=False, apply=apply, active=lambda r: r.convert,
    example={"convert": True})
