"""ZeroRedundancyOptimizer's state in a DCP checkpoint, by parameter name.

Under ``sharding=zero1`` each rank's optimizer holds the state of its own partition of the
parameters, and ``torch.distributed.checkpoint``'s ``get_state_dict`` does not take a
ZeroRedundancyOptimizer. Each rank therefore saves the entries it holds under
``zero1.<parameter name>.<state key>`` (the ranks' keys are disjoint, and DCP's plan is their
union), and on resume each rank reads exactly the entries of the parameters it owns now —
another world size partitions differently, and still finds every entry, by name. Tensors are
allocated from the checkpoint's own metadata (shape and dtype), so nothing is loaded that this
rank does not keep.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from ..errors import FasttrainError

PREFIX = "zero1"


def _names(model: torch.nn.Module) -> dict[int, str]:
    """Parameter id → its name in the model's state dict (without DDP's ``module.`` and
    compile's ``_orig_mod.``)."""
    inner = getattr(model, "module", model)
    return {id(p): n.replace("_orig_mod.", "")
            for n, p in inner.named_parameters(remove_duplicate=False)}


def _local(optimizer) -> list[torch.Tensor]:
    """The parameters whose state this rank's ZeroRedundancyOptimizer holds."""
    return [p for group in optimizer.optim.param_groups for p in group["params"]]


def saved(model: torch.nn.Module, optimizer) -> dict[str, dict[str, Any]]:
    """This rank's entries: ``{parameter name: {state key: tensor}}``."""
    names = _names(model)
    return {names[id(p)]: dict(optimizer.optim.state[p]) for p in _local(optimizer)
            if optimizer.optim.state.get(p)}


def targets(model: torch.nn.Module, optimizer,
            meta: dcp_metadata.Metadata) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors, shaped and typed as the checkpoint holds them, for the entries of the
    parameters this rank owns now; a parameter the checkpoint has no state for is refused."""
    names, stored = _names(model), meta.state_dict_metadata
    out: dict[str, dict[str, torch.Tensor]] = {}
    for p in _local(optimizer):
        name = names[id(p)]
        head = f"{PREFIX}.{name}."
        keys = {k[len(head):]: v for k, v in stored.items()
                if k.startswith(head) and "." not in k[len(head):]}
        if not keys:
            raise FasttrainError(f"resume: the checkpoint holds no zero1 optimizer state for "
                                 f"{name}: resume it with the run that saved it")
        out[name] = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype, device=p.device)
                     for k, v in keys.items()
                     if isinstance(v, dcp_metadata.TensorStorageMetadata)}
    return out


def restore(model: torch.nn.Module, optimizer, loaded: dict[str, dict[str, torch.Tensor]]):
    """Put the loaded entries into this rank's optimizer state (AdamW keeps its step count on
    the host unless fused or capturable)."""
    names = _names(model)
    for group in optimizer.optim.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            entry = loaded.get(names[id(p)])
            if entry:
                optimizer.optim.state[p] = {
                    k: v if k != "step" or on_device else v.cpu() for k, v in entry.items()}
