"""CUDA caching-allocator settings: expandable segments.

When it helps: shapes that change between steps (variable sequence lengths, a growing batch in a
search, EMA or eval interleaved with training) make the caching allocator cudaMalloc and free
segments again and again, fragmenting memory into a saw-tooth of reserved memory; expandable
segments grow one mapping instead. It must be set before CUDA starts in the process — the ladder
and fit start a fresh process per trial with the setting in its environment; inside a running
process it is verified and a late setting is reported, never silently ignored.
"""
from __future__ import annotations

import os

import torch

from ..recipe import Recipe
from .base import Phase, Technique, TrainState

ENV = "PYTORCH_CUDA_ALLOC_CONF"
SETTING = "expandable_segments:True"


def child_env(recipe: Recipe) -> dict[str, str]:
    """Environment a fresh process needs for this recipe's allocator."""
    if recipe.allocator != "expandable":
        return {}
    current = os.environ.get(ENV, "")
    return {ENV: ",".join(x for x in (current, SETTING) if x and SETTING not in current) or current}


def configure(recipe: Recipe) -> str | None:
    """Set the allocator before CUDA starts; returns a warning when it is too late."""
    if recipe.allocator != "expandable":
        return None
    if SETTING in os.environ.get(ENV, ""):
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "expandable: CUDA already started in this process; the setting takes effect only " \
               "in a fresh process (the ladder and fit start one)"
    os.environ.update(child_env(recipe))
    return None


def apply(state: TrainState) -> str | None:
    conf = os.environ.get(ENV, "")
    if not state.cuda:
        state.idle("allocator", "allocator settings apply to CUDA only; no effect on CPU")
        return None
    if state.recipe.allocator == "expandable":
        if SETTING not in conf:
            state.idle("allocator", "expandable segments are NOT in effect")
            return None
        return f"{ENV}={conf} (set before CUDA started)"
    return None


TECHNIQUE = Technique(
    name="allocator", phase=Phase.ALLOCATOR, summary="CUDA allocator: expandable segments",
    changes_numerics=False, apply=apply, active=lambda r: r.allocator != "default",
    example={"allocator": "expandable"})
