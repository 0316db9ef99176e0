"""channels_last (NHWC) memory format for convolutions.

When it helps: tensor-core convolutions run in NHWC; with NCHW cuDNN transposes around every
conv. Convolutions whose input has fewer than 8 channels' worth of 16 bytes (an RGB image, SD's
4 latent channels) get zero channels appended (``layers/conv.py``): NHWC tensor-core kernels
read a pixel's channels in 16-byte pieces. Numerics: none (a layout; a padded channel adds exact
zeros). It does nothing for a model without 4-D convolutions — then it says so.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..layers.conv import needs_padding, pad_channels
from .base import Technique, TrainState


def apply(state: TrainState) -> str | None:
    convs = [m for m in state.model.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        state.warn("channels_last", "the model has no Conv2d; nothing converted")
        return None
    state.model.to(memory_format=torch.channels_last)
    for m in state.model.modules():  # models convert their image inputs when asked
        if hasattr(m, "channels_last"):
            m.channels_last = True
    padded = Counter(pad_channels(m) for m in convs if needs_padding(m))
    pads = "".join(f"; input channels {what} (zeros) for {n} Conv2d"
                   for what, n in sorted(padded.items()))
    return f"NHWC weights for {len(convs)} Conv2d{pads}"


TECHNIQUE = Technique(
    name="channels_last", phase=10, summary="NHWC memory format for convolutions",
    changes_numerics=False, apply=apply, active=lambda r: r.channels_last)
