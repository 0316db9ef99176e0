"""Techniques, one module per switch, applied in a fixed phase order.

Order and why:
  init           the model is built before everything (on the device, in the target dtype).
  allocator      before the first CUDA allocation of the process (checked, not assumed).
  convert        public model classes swapped for fasttrain layers: before the probe, the
                 stream cast and the kernels switch, which look for fasttrain's layers.
  channels_last  before precision and compile: compile specialises on the memory format.
  precision      before compile: bf16-true changes parameter dtypes that compile guards on.
  stream_dtype   the models' residual-stream cast: before compile, which traces it.
  attention      a per-step context; before compile so the traced graph sees the backend.
  kernels        fused layer paths: after the FLOP probe, before compile (which traces them).
  fp8            float8 linear layers: after the FLOP probe, before checkpointing and compile.
  gemm_pad       odd output widths padded (class swap, as fp8's): after the FLOP probe (model
                 FLOPs are the unpadded model's) and fp8, before checkpointing and compile.
  checkpointing  wraps block forwards after the FLOP probe (recompute is not model FLOPs) and
                 before compile, which must trace the checkpointed forward.
  compile        after all module surgery, before the optimizer: the optimizer must hold the
                 parameters that the compiled module uses (compile does not copy them).
  sharding       after compile (per-block compile, then DDP/FSDP2 around it: torchtitan's
                 order) and before the optimizer, which must see FSDP2's sharded parameters.
  optimizer      after precision (bf16-true state is bf16) and on the final parameters.
  ema            after the optimizer, on the same parameters.
  dataloader     independent of the model; recorded with the rest.
  padding        the loader's collate: variable-length batches padded to a multiple of N.
  cuda_graphs    last: it captures whatever the phases above produced.
  graph_memset_kernels  edits that capture (the rewrite runs when the step is captured).
  accumulation   consumed by the loop.
"""
from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from ..recipe import Recipe
from ..workloads.base import Workload
from .base import Phase, Technique, TrainState

_MODULES = ("init", "allocator", "convert", "channels_last", "precision", "stream",
            "attention", "kernels", "fp8", "gemm_pad",
            "checkpointing", "compile", "sharding", "optimizer", "ema", "dataloader", "padding",
            "cuda_graphs", "graph_memsets", "accumulation")


def registry() -> list[Technique]:
    """Every technique card, in phase order."""
    techs = [importlib.import_module(f"{__name__}.{m}").TECHNIQUE for m in _MODULES]
    return sorted(techs, key=lambda t: t.phase)


FIELD_TECHNIQUE = {
    "workers": "dataloader", "pin_memory": "dataloader", "non_blocking": "dataloader",
    "prefetch_factor": "dataloader", "device_prefetch": "dataloader",
    "pad_multiple": "padding", "ema_decay": "ema", "checkpoint_every": "checkpointing",
    "compile_mode": "compile", "compile_backend": "compile", "compile_cache": "compile",
    "optimizer_impl": "optimizer", "schedule": "optimizer", "lr_warmup": "optimizer",
    "offload": "optimizer",
}
"""Recipe fields served by a technique of another name. A technique's name is its own field
(``precision``, ``attention``, ``fp8``); switches that report on their own (``pdl``,
``combo_kernels``, ``autotune_reductions``, ``master_weights``) keep their field's name."""


def technique_of(field: str) -> str:
    """The key under which a run's ``no_effect`` would name the recipe field ``field``."""
    return FIELD_TECHNIQUE.get(field, field)


def unmet_requirements(recipe: Recipe, device_type: str) -> list[str]:
    """Why this recipe cannot run on this device (empty when it can)."""
    out = []
    for tech in [t for t in registry() if t.active(recipe)]:
        if "cuda" in tech.requires and device_type != "cuda":
            out.append(f"{tech.name} needs CUDA")
        elif why := tech.unmet(recipe, device_type):
            out.append(why)
    return out


PROBE_AFTER = Phase.ATTENTION
"""The eager probe step (model FLOPs, which attention kernels ran) runs after this phase: on the
model as built, in its precision and layout, before fused kernels, fp8, padding, checkpointing
and compile change how it computes (model FLOPs are the plain model's)."""


def apply_all(state: TrainState, after: int = -1, upto: int = 1000) -> TrainState:
    """Apply the active techniques whose phase lies in (after, upto], in order."""
    for tech in registry():
        if after < tech.phase <= upto and tech.active(state.recipe):
            did = tech.apply(state)
            if did:
                state.applied[tech.name] = did
    return state


def apply_before_probe(state: TrainState) -> TrainState:
    """Layout, precision, the residual stream and the attention backend: what the probe sees."""
    return apply_all(state, upto=PROBE_AFTER)


def apply_after_probe(state: TrainState) -> TrainState:
    """Fused paths, compile, sharding, optimizer, EMA, loader, graphs."""
    return apply_all(state, after=PROBE_AFTER)


def probe_contexts(state: TrainState) -> contextlib.ExitStack:
    """Enter the probe hooks of the active techniques, for one probe step; each records what it
    saw when the stack closes without an error."""
    stack = contextlib.ExitStack()
    for tech in registry():
        if tech.probe is not None and tech.active(state.recipe):
            stack.enter_context(tech.probe(state))
    return stack


def finish_all(state: TrainState) -> None:
    """Run the finish hooks of the active techniques, after the timed steps."""
    for tech in registry():
        if tech.finish is not None and tech.active(state.recipe):
            tech.finish(state)


def prepare_process(recipe: Recipe) -> str | None:
    """What must happen before the process's first CUDA allocation (the allocator's settings);
    a warning where it came too late."""
    from . import allocator

    return allocator.configure(recipe)


def build_model(workload: Workload, recipe: Recipe, device: torch.device) -> nn.Module:
    """The workload's model, built the way the recipe's ``init`` asks."""
    from . import init

    return init.build_model(workload, recipe, device)


__all__ = ["FIELD_TECHNIQUE", "PROBE_AFTER", "Phase", "Technique", "TrainState",
           "apply_after_probe", "apply_all", "apply_before_probe", "build_model", "finish_all",
           "prepare_process", "probe_contexts", "registry", "technique_of", "unmet_requirements"]
