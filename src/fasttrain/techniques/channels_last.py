"""channels_last (NHWC) memory format for convolutions.

When it helps: tensor-core convolutions run in NHWC; with NCHW cuDNN transposes around every
conv. Convolutions over fewer than 8 input channels (an RGB image, SD's 4 latent channels), for
which cuDNN has no fast NHWC kernel, run as a gather and one GEMM (``layers/conv.py``).
Numerics: none beyond the order of fp32 sums (a layout). It does nothing for a model without
4-D convolutions — then it says so.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..layers.conv import as_gemm, fits_gemm
from ..layers.fused import ImageInput
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str | None:
    convs = [m for m in state.model.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        state.idle("channels_last", "the model has no Conv2d; nothing converted")
        return None
    state.model.to(memory_format=torch.channels_last)
    for m in state.model.modules():  # models convert their image inputs when asked
        if isinstance(m, ImageInput):
            m.channels_last = True
    gemms = Counter(as_gemm(m) for m in convs if fits_gemm(m))
    as_gemms = "".join(f"; {what} as a gather + GEMM ×{n}" for what, n in sorted(gemms.items()))
    return f"NHWC weights for {len(convs)} Conv2d{as_gemms}"


TECHNIQUE = Technique(
    name="channels_last", phase=Phase.CHANNELS_LAST, summary="NHWC memory format for convolutions",
    changes_numerics=False, apply=apply, active=lambda r: r.channels_last,
    example={"channels_last": True})
