"""FP8 matmuls for the linear layers of the trainable repeated blocks (``fp8=linear``).

When it helps: GEMM-bound transformers on Hopper/Ada — float8 tensor cores run at twice the
bf16 rate, and the input each layer saves for backward shrinks to one byte per value. The
casts are memory-bound passes, so layers with few tokens or narrow widths gain little; the
fast preset measures whether the whole step gains. Numerics: e4m3 keeps 3 mantissa bits, e5m2
(the gradients) 2, with fp32 accumulation: a visible but small change of the loss, which the
parity gate checks. Heads, embeddings and frozen modules keep their precision (the usual
practice: the first and last layers are the most sensitive). Requirements: bf16 precision;
on CUDA compute capability 8.9+ (on the CPU torch's reference kernel runs, for tests).
Applied after the FLOP probe (model FLOPs are the bf16 model's) and before checkpointing and
compile, which must trace the fp8 path.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..layers.linear import FP8_ALIGN as ALIGN, FP8_LARGE as LARGE, Float8Linear
from .base import Phase, Technique, TrainState


def fp8_targets(blocks: list[nn.Module], mode: str = "linear") -> tuple[list[nn.Linear], int]:
    """Plain ``nn.Linear`` layers with trainable weights inside ``blocks`` whose widths are
    multiples of 16 (and, for ``mode='large'``, that hold at least 2²⁴ weights); and how many
    other linear layers were left out for their widths or size."""
    chosen, unaligned, seen = [], 0, set()
    for block in blocks:
        for m in block.modules():
            if type(m) is not nn.Linear or id(m) in seen or not m.weight.requires_grad:
                continue
            seen.add(id(m))
            small = mode == "large" and m.in_features * m.out_features < LARGE
            if m.in_features % ALIGN or m.out_features % ALIGN or small:
                unaligned += 1
            else:
                chosen.append(m)
    return chosen, unaligned


def apply(state: TrainState) -> str | None:
    if state.cuda and torch.cuda.get_device_capability(state.device) < (8, 9):
        name = torch.cuda.get_device_name(state.device)
        state.idle("fp8", f"{name} has no float8 tensor cores (needs compute capability 8.9+); "
                          "the linear layers stay in bf16")
        return None
    mode = state.recipe.fp8
    layers, unaligned = fp8_targets(state.workload.regional_blocks(state.model), mode)
    if not layers:
        size = " and at least 2^24 weights" if mode == "large" else ""
        state.idle("fp8", f"no trainable nn.Linear with widths divisible by 16{size} in the "
                          "repeated blocks; fp8 changes nothing")
        return None
    for m in layers:
        m.__class__ = Float8Linear  # same parameters, hooks and state-dict keys
    shapes = Counter(f"{m.in_features}→{m.out_features}" for m in layers)
    listing = ", ".join(f"{s} ×{n}" for s, n in shapes.most_common(4))
    more = f", {len(shapes) - 4} more shapes" if len(shapes) > 4 else ""
    why = "smaller than 2^24 weights or " if mode == "large" else ""
    kept = f"; {unaligned} kept in bf16 ({why}widths not divisible by 16)" if unaligned else ""
    where = "" if state.cuda else " (CPU: torch's reference float8 kernel)"
    return (f"{len(layers)} linear layers in float8{where}: {listing}{more}{kept}; calls "
            "whose token count is not divisible by 16 run in bf16")


TECHNIQUE = Technique(
    name="fp8", phase=Phase.FP8, summary="float8 matmuls for the blocks' linear layers",
    changes_numerics=True, apply=apply, active=lambda r: r.fp8 != "none",
    example={"precision": "bf16-mixed", "fp8": "linear"})
