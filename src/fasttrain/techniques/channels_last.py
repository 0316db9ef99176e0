"""channels_last (NHWC) memory format for convolutions.

When it helps: tensor-core convolutions run in NHWC; with NCHW cuDNN transposes around every
conv. Numerics: none (a layout). It does nothing for a model without 4-D convolutions — then it
says so.
"""
from __future__ import annotations

import torch
from torch import nn

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
    return f"NHWC weights for {len(convs)} Conv2d"


TECHNIQUE = Technique(
    name="channels_last", phase=10, summary="NHWC memory format for convolutions",
    changes_numerics=False, apply=apply, active=lambda r: r.channels_last)
