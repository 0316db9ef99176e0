"""CUDA graphs: capture the whole step (forward, backward, clip, optimizer) once, replay it.

When it helps: small or launch-bound steps, where the CPU cannot issue kernels as fast as the GPU
runs them. Numerics: none. Requirements: CUDA, static shapes, no host syncs in the step (hence
no GradScaler and a capturable optimizer), one micro-batch per step. The item count may vary
(it is a static input of the graph); the shapes may not. The capture itself lives in
run/graphs.py; this card checks and records.
"""
from __future__ import annotations

from ..errors import FasttrainError
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str:
    if not state.cuda:
        raise ValueError("cuda_graphs needs a CUDA device")
    wl, r = state.workload, state.recipe
    cap = getattr(wl, "max_length", None)
    if wl.pad_fields and not (r.pad_multiple and cap and r.pad_multiple >= cap):
        # A captured step replays one shape; the item count is a static input and may vary.
        how = f"set pad_multiple={cap} (one shape) or turn cuda_graphs off" if cap else \
            "turn cuda_graphs off"
        raise FasttrainError(f"cuda_graphs: {wl.name} batches are padded to their longest item, "
                             f"so their shapes vary and a captured step cannot follow; {how}")
    state.autocast_cache = False
    return "whole step captured after warm-up; batches copied into static inputs"


TECHNIQUE = Technique(
    name="cuda_graphs", phase=Phase.CUDA_GRAPHS, summary="whole-step CUDA graph capture and replay",
    changes_numerics=False, apply=apply, requires=("cuda",), active=lambda r: r.cuda_graphs,
    example={"cuda_graphs": True})
