"""Optimizer implementation: for-loop, foreach (multi-tensor) or fused AdamW.

When it helps: always on GPUs with many parameter tensors — the source measured Adam at 125.6 ms
in 6,860 elementwise kernels, and 25.0 ms in 47 multi-tensor kernels once fused. Numerics: the
same update math; fused and foreach differ from the for-loop only by rounding order.
"""
from __future__ import annotations

import torch

from .base import Technique, TrainState


def build(params, recipe, lr: float, capturable: bool = False) -> torch.optim.Optimizer:
    impl = recipe.optimizer_impl
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=recipe.weight_decay,
        foreach=(impl == "foreach"), fused=(impl == "fused") or None,
        capturable=capturable)


def apply(state: TrainState) -> str:
    params = [p for p in state.trainable.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the trainable module has no parameters that require grad")
    # CUDA graph replay needs the step count on the device (capturable) so no host sync occurs.
    capturable = state.recipe.cuda_graphs and state.cuda
    lr = state.recipe.lr or state.workload.reference_lr
    state.optimizer = build(params, state.recipe, lr, capturable)
    n = sum(p.numel() for p in params)
    return (f"AdamW {state.recipe.optimizer_impl}, lr {lr:g}, over {len(params)} tensors "
            f"({n / 1e6:.1f} M params){', capturable' if capturable else ''}")


TECHNIQUE = Technique(
    name="optimizer", phase=60, summary="AdamW: for-loop | foreach | fused",
    changes_numerics=False, apply=apply)
