"""Data parallelism on torch.distributed: DDP, ZeRO-1, and FSDP2 as ZeRO-2/ZeRO-3.

ddp     DistributedDataParallel with gradients as bucket views (no extra gradient copy) and a
        static graph where the model is eager (the graph is the same every step).
zero1   DDP + ZeroRedundancyOptimizer: each rank keeps 1/N of the optimizer state.
zero2   FSDP2 ``fully_shard`` per repeated block, then the root, keeping gathered weights after
        the forward (reshard_after_forward=False): gradients and optimizer state sharded.
zero3   the same with full resharding after the forward: weights sharded too.
Mixed precision under FSDP2 is its MixedPrecisionPolicy (bf16 compute, fp32 reduce); offload
``params`` is its CPUOffloadPolicy. Numerics: the same gradient up to the reduction order (the
loop scales each rank's loss so the averaged gradient is the gradient of the global batch).
Order (torchtitan's): activation checkpointing → compile (per block) → sharding → optimizer.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..distributed import env
from .base import Phase, Technique, TrainState


def resolve(recipe, world: int) -> str:
    if recipe.sharding == "auto":
        return "ddp" if world > 1 else "none"
    return recipe.sharding


def _ddp(state: TrainState) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [state.device.index if state.device.index is not None else 0] if state.cuda else None
    return DDP(state.model, device_ids=ids, gradient_as_bucket_view=True,
               static_graph=_static(state.recipe))


def _static(recipe) -> bool:
    # The same graph every step, but DDP's static graph trips an internal assert under no_sync
    # (accumulation), and compiled modules change its hook order: eager, one micro-batch only.
    return recipe.compile == "none" and recipe.accumulation == 1


def _fsdp(state: TrainState, reshard: bool) -> int:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": reshard}
    if state.recipe.precision == "bf16-mixed":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if state.recipe.offload == "params":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=state.cuda)
    blocks = [b for b in state.workload.regional_blocks(state.model)
              if any(p.requires_grad for p in b.parameters())]
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(state.model, **kw)
    return len(blocks)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def apply(state: TrainState) -> str | None:
    d = env.current()
    mode = resolve(state.recipe, d.world)
    state.world = d.world
    if mode == "none":
        if d.active:
            raise ValueError("sharding=none with several processes would train N separate models")
        return None
    if not d.active:
        state.idle("sharding", f"{mode} asked for, but this is a single process; nothing sharded")
        return None
    if mode in ("ddp", "zero1"):
        state.model = _ddp(state)
        state.no_sync = state.model.no_sync
        state.zero1 = mode == "zero1"
        return (f"{mode}: DDP over {d.world} ranks, gradient-as-bucket-view"
                + (", static graph" if _static(state.recipe) else "")
                + ("; optimizer state sharded (ZeroRedundancyOptimizer)" if state.zero1 else ""))
    n = _fsdp(state, reshard=mode == "zero3")
    state.no_sync = functools.partial(_fsdp_no_sync, state.model)
    return (f"{mode}: FSDP2 over {d.world} ranks, {n} blocks + root, reshard after forward "
            f"{mode == 'zero3'}" + (", CPU offload" if state.recipe.offload == "params" else ""))


TECHNIQUE = Technique(
    name="sharding", phase=Phase.SHARDING, summary="DDP / ZeRO-1 / FSDP2 (ZeRO-2, ZeRO-3)",
    changes_numerics=False, apply=apply, active=lambda r: r.sharding != "none",
    example={"sharding": "ddp"})
