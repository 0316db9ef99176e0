"""Gradient accumulation: k micro-batches per optimizer step.

When it helps: the batch does not fit at once. Numerics: the loop divides each micro-batch's
summed loss by the item count of the whole step, so k micro-batches give the gradient of one
big batch (exactly in fp32 up to summation order).
"""
from __future__ import annotations

from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str:
    k = state.recipe.accumulation
    return f"{k} micro-batches of {state.micro_batch}, loss normalised by the step's item count"


TECHNIQUE = Technique(
    name="accumulation", phase=Phase.ACCUMULATION, summary="k micro-batches per optimizer step",
    changes_numerics=False, apply=apply, active=lambda r: r.accumulation > 1,
    example={"accumulation": 2})
