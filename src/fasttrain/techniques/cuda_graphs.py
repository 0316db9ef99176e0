"""CUDA graphs: capture the whole step (forward, backward, clip, optimizer) once, replay it.

When it helps: small or launch-bound steps, where the CPU cannot issue kernels as fast as the GPU
runs them. Numerics: none. Requirements: CUDA, static shapes, no host syncs in the step (hence
no GradScaler and a capturable optimizer), one micro-batch per step. The capture itself lives in
run/graphs.py; this card checks and records.
"""
from __future__ import annotations

from ..errors import FasttrainError
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str:
    if not state.cuda:
        raise ValueError("cuda_graphs needs a CUDA device")
    if not state.workload.constant_count:
        # The step divides the summed loss by the batch's item count, a number the capture
        # would freeze: batches with other counts (padding, ignored labels) would train with
        # the wrong scale.
        raise FasttrainError(f"cuda_graphs: {state.workload.name} batches hold varying item "
                             "counts (padding or ignored labels), which a captured step cannot "
                             "follow; turn cuda_graphs off")
    state.autocast_cache = False
    return "whole step captured after warm-up; batches copied into static inputs"


TECHNIQUE = Technique(
    name="cuda_graphs", phase=Phase.CUDA_GRAPHS, summary="whole-step CUDA graph capture and replay",
    changes_numerics=False, apply=apply, requires=("cuda",), active=lambda r: r.cuda_graphs,
    example={"cuda_graphs": True})
