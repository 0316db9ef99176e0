"""fasttrain's fused kernels (``src/fasttrain/kernels/``), switched on where a model has a path.

A layer with a fused path is a ``layers.fused.FusedLayer``: it names its family in
``fused_kind``, says whether its path is a Triton kernel (``fused_triton``) and whether it takes
attention away from SDPA (``replaces_sdpa``: the run's attention line then names the kernel), and
switches with ``use_fused(on)``. ``kernels=fused`` switches on every family, a comma-separated
list only those named (``recipe.KERNEL_FAMILIES``), so that each family can be measured alone.
When it helps: memory-bound work around the GEMMs that torch.compile cannot remove on its own
(the full logits of an LLM's loss, Swin's 49-token windows). Numerics: the same maths in another
summation order, checked by the parity gate. Applied after the FLOP probe (model FLOPs count the
plain path) and before compile, which must trace the fused path.
"""
from __future__ import annotations

import sys
from collections import Counter

from torch import nn

from ..layers.fused import fused_layers, partial_fused_layers, switch_fused, triton_unavailable
from ..recipe import kernel_families
from .base import Phase, Technique, TrainState


def _frozen_narrow_convs(model: nn.Module) -> None:
    """Give the ``conv`` family its layers where channels_last has not: frozen convolutions over
    few channels become GemmConv2d (their fused path is forward-only)."""
    from ..layers.conv import as_gemm, frozen_narrow

    for m in model.modules():
        if frozen_narrow(m):
            as_gemm(m)


def apply(state: TrainState) -> str | None:
    wanted = kernel_families(state.recipe.kernels)
    if "conv" in wanted:
        _frozen_narrow_convs(state.model)
    partial = sorted({type(m).__name__ for m in partial_fused_layers(state.model)})
    if partial:
        state.warn("kernels", f"{', '.join(partial)} offer use_fused but not the rest of "
                   "layers.fused.FusedLayer (fused_kind, fused, fused_triton, replaces_sdpa, "
                   "attention_name): left as they are; inherit layers.fused.FusedPath")
    if state.workload.converts and not state.recipe.convert:
        state.warn("kernels", f"{state.workload.name} is a public model: its classes have no "
                   "fused paths until converted; set convert=true")
    layers = fused_layers(state.model)
    route = _route_sdpa(state, wanted, layers)
    missing = sorted(wanted - {m.fused_kind for m in layers} - ({"attention"} if route else set()))
    if missing and state.recipe.kernels != "fused":
        state.warn("kernels", f"{state.workload.name} has no {', '.join(missing)} layer")
    done, kept, no_triton = switch_fused(layers, wanted, state.device)
    if kept:
        state.warn("kernels", f"{', '.join(sorted(kept))}: {no_triton}; plain path kept")
    replaced = Counter((m.fused_kind, m.attention_name) for m in layers
                       if m.replaces_sdpa and m.fused)
    if replaced:  # the attention line came from the probe, which ran the plain layers
        state.applied["attention"] = "; ".join(
            f"the Triton {name} kernel in {n} layers (kernels={kind}); SDPA is not called"
            for (kind, name), n in replaced.items())
    if not done and not route:
        if not layers:
            state.warn("kernels", f"{state.workload.name} has no layer with a fused kernel; "
                                  f"kernels={state.recipe.kernels} changes nothing")
        state.no_effect["kernels"] = f"no fused path switched on (kernels={state.recipe.kernels})"
        return None
    return "; ".join(f"{what} ×{n}" for what, n in done.items()) or None


def _route_sdpa(state: TrainState, wanted: frozenset[str], layers: list) -> bool:
    """``attention`` wanted, a model without a fasttrain attention layer: its own calls of
    F.scaled_dot_product_attention go to the Triton kernel where it takes them
    (``layers/sdpa_route.py``), around every forward; ``finish`` says what it routed."""
    if ("attention" not in wanted or any(m.fused_kind == "attention" for m in layers)
            or triton_unavailable(state.device)):
        return False
    from ..layers.sdpa_route import SdpaRoute

    state.step_contexts.append(SdpaRoute().active)
    return True


def finish(state: TrainState) -> None:
    """The SDPA route's counts in the kernels line where it routed a call (and in the
    attention line, which the probe wrote before it); no effect where it routed none and no
    fused path was switched on."""
    mod = sys.modules.get("fasttrain.layers.sdpa_route")
    routes = [c.__self__ for c in state.step_contexts
              if mod and isinstance(getattr(c, "__self__", None), mod.SdpaRoute)]
    for route in routes:
        if route.routed:
            state.note("kernels", route.summary())
            state.note("attention", f"then, kernels=attention: {route.summary()}")
        elif not any(m.fused for m in fused_layers(state.model)):
            state.idle("kernels", "no fused path switched on and no SDPA call routed "
                       f"({route.summary() or 'no call seen'})")


TECHNIQUE = Technique(
    name="kernels", phase=Phase.KERNELS, summary="fused kernels where a layer has them",
    changes_numerics=True, apply=apply, active=lambda r: r.kernels != "none", finish=finish,
    example={"kernels": "fused"})
