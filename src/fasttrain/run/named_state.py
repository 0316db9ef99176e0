"""Optimizer state that ``get_state_dict`` cannot take, saved in a DCP checkpoint by parameter
name: ZeroRedundancyOptimizer's partitions (``sharding=zero1``) and the ShadowOptimizer's fp32
copies (``offload=optimizer``, bf16-true's ``master_weights``).

Both step tensors that are not the model's parameters: a partition of them (zero1) or fp32
copies of them (shadow). Each entry is saved under ``PREFIX.<parameter name>.<state key>``;
under zero1 the ranks' keys are disjoint and DCP's plan is their union, and on resume each rank
reads exactly the entries of the parameters it owns now — another world size partitions
differently and still finds every entry, by name. Targets are allocated from the checkpoint's
own metadata (shape and dtype), so nothing is loaded that this rank does not keep. A shadow
optimizer's fp32 copies are also the checkpoint's model weights (the bf16 or offloaded
parameters are their rounding), loaded in place and copied back to the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from ..errors import FasttrainError
from ..techniques.optimizer import ShadowOptimizer


@dataclass
class Holder:
    """Where the state lives: ``prefix`` of its keys, (name, stepped tensor) pairs, the inner
    optimizer whose ``state`` and ``param_groups`` hold it."""

    prefix: str
    stepped: list[tuple[str, torch.Tensor]]
    inner: torch.optim.Optimizer


def _names(model: torch.nn.Module) -> dict[int, str]:
    """Parameter id → its name in the model's state dict (without DDP's ``module.`` and
    compile's ``_orig_mod.``)."""
    inner = getattr(model, "module", model)
    return {id(p): n.replace("_orig_mod.", "")
            for n, p in inner.named_parameters(remove_duplicate=False)}


def holder(model: torch.nn.Module, optimizer, zero1: bool) -> Holder | None:
    """The named state of ``optimizer``, or None where ``get_state_dict`` takes it."""
    names = _names(model)
    if zero1:
        local = [p for g in optimizer.optim.param_groups for p in g["params"]]
        return Holder("zero1", [(names[id(p)], p) for p in local], optimizer.optim)
    if isinstance(optimizer, ShadowOptimizer):
        return Holder("shadow", [(names[id(p)], s) for p, s in
                                 zip(optimizer.params, optimizer.shadow)], optimizer.inner)
    return None


def weights(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """A shadow optimizer's fp32 copies by the weights' names: the checkpoint's model entries
    (loading fills them in place); empty for other optimizers."""
    if not isinstance(optimizer, ShadowOptimizer):
        return {}
    names = _names(model)
    return {names[id(p)]: s.detach() for p, s in zip(optimizer.params, optimizer.shadow)}


def saved(h: Holder) -> dict[str, dict[str, Any]]:
    """This rank's entries: ``{parameter name: {state key: tensor}}``."""
    return {name: dict(h.inner.state[t]) for name, t in h.stepped if h.inner.state.get(t)}


def targets(h: Holder, meta: dcp_metadata.Metadata) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors, shaped and typed as the checkpoint holds them, for the entries of the
    tensors this rank steps; one the checkpoint has no state for is refused."""
    stored = meta.state_dict_metadata
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in h.stepped:
        head = f"{h.prefix}.{name}."
        keys = {k[len(head):]: v for k, v in stored.items()
                if k.startswith(head) and "." not in k[len(head):]}
        if not keys:
            raise FasttrainError(f"resume: the checkpoint holds no {h.prefix} optimizer state "
                                 f"for {name}: resume it with the recipe that saved it")
        out[name] = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype, device=t.device)
                     for k, v in keys.items()
                     if isinstance(v, dcp_metadata.TensorStorageMetadata)}
    return out


def restore(h: Holder, loaded: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put the loaded entries into the inner optimizer's state (AdamW keeps its step count on
    the host unless fused or capturable)."""
    by_id = {id(t): name for name, t in h.stepped}
    for group in h.inner.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for t in group["params"]:
            entry = loaded.get(by_id.get(id(t), ""))
            if entry:
                h.inner.state[t] = {k: v if k != "step" or on_device else v.cpu()
                                    for k, v in entry.items()}
