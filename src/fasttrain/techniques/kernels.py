"""fasttrain's fused kernels (``src/fasttrain/kernels/``), switched on where a model has a path.

A layer with a fused path exposes ``use_fused(on) -> list[str]`` (``layers/``); this technique
calls it on every such module and reports what was fused. When it helps: memory-bound work
around the GEMMs that torch.compile cannot remove on its own (e.g. the full logits of an LLM's
loss). Numerics: the same maths in another summation order, checked by the parity gate.
Applied after the FLOP probe (model FLOPs count the plain path) and before compile, which must
trace the fused path.
"""
from __future__ import annotations

from collections import Counter

from torch import nn

from .base import Technique, TrainState


def fused_layers(model: nn.Module) -> list[nn.Module]:
    """The layers with a fused path (they expose ``use_fused``)."""
    return [m for m in model.modules() if callable(getattr(m, "use_fused", None))]


def apply(state: TrainState) -> str | None:
    done: Counter = Counter()
    for module in fused_layers(state.model):
        done.update(module.use_fused(True))
    if not done:
        state.warn("kernels", f"{state.workload.name} has no layer with a fused kernel; "
                              "kernels=fused changes nothing")
        return None
    return "; ".join(f"{what} ×{n}" for what, n in done.items())


TECHNIQUE = Technique(
    name="kernels", phase=32, summary="fused kernels where a layer has them",
    changes_numerics=True, apply=apply, active=lambda r: r.kernels != "none")
