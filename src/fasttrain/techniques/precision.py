"""Precision: fp32 / TF32 / fp16 autocast + GradScaler / bf16 autocast / bf16 weights.

When it helps: always on tensor-core GPUs (the source: TF32 → FP16 AMP 1.18× on SD, 1.63× on
Swin). Numerics: TF32 rounds matmul inputs to 10 mantissa bits; autocast runs matmuls and
convolutions in 16-bit and keeps reductions in fp32; bf16-true also stores weights, gradients
and optimizer state in bf16 (half the memory, the least accurate).
"""
from __future__ import annotations

import functools

import torch

from .base import Phase, Technique, TrainState


def _matmul_flags(state: TrainState, tf32: bool) -> None:
    state.set_flag(torch.backends.cuda.matmul, "allow_tf32", tf32)
    state.set_flag(torch.backends.cudnn, "allow_tf32", tf32)


def apply(state: TrainState) -> str:
    p = state.recipe.precision
    _matmul_flags(state, tf32=(p != "fp32"))
    if p in ("fp32", "tf32"):
        if p == "tf32" and not state.cuda:
            state.idle("precision", "tf32 has no effect on CPU (plain fp32 math)")
            return "fp32 (TF32 is a CUDA feature)"
        return "fp32 weights and math" + (", TF32 matmuls" if p == "tf32" else ", TF32 off")
    if p == "bf16-true":
        state.model.to(torch.bfloat16)
        return "bf16 weights, gradients and optimizer state (no autocast)"
    dtype = torch.float16 if p == "fp16-mixed" else torch.bfloat16
    state.step_contexts.append(functools.partial(
        _autocast, state.device.type, dtype, state))
    frozen = _cast_frozen(state, dtype)
    note = f"; frozen {', '.join(frozen)} stored in {str(dtype)[6:]}" if frozen else ""
    if p == "fp16-mixed":
        state.scaler = torch.amp.GradScaler(state.device.type)
        return "fp16 autocast with dynamic loss scaling (GradScaler)" + note
    return "bf16 autocast, fp32 weights" + note


def _cast_frozen(state: TrainState, dtype: torch.dtype) -> list[str]:
    """Store frozen top-level submodules (SD's VAE and text encoder) in the autocast dtype.

    Autocast would cast their fp32 weights to 16 bits on every step; nothing trains them, so
    keeping one 16-bit copy saves those casts and half their memory (the Hugging Face
    text-to-image recipe does the same).
    """
    names = []
    for name, child in state.model.named_children():
        params = list(child.parameters())
        if params and not any(p.requires_grad for p in params):
            child.to(dtype)
            names.append(name)
    return names


def _autocast(device_type: str, dtype: torch.dtype, state: TrainState):
    # The cache of casted weights must be off under CUDA graph capture (stale casts otherwise).
    return torch.autocast(device_type, dtype=dtype, cache_enabled=state.autocast_cache)


TECHNIQUE = Technique(
    name="precision", phase=Phase.PRECISION, summary="fp32 / tf32 / fp16-mixed / bf16-mixed / bf16-true",
    changes_numerics=True, apply=apply, active=lambda r: True,
    example={"precision": "bf16-mixed"})
