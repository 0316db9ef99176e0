"""The peer of a user's own workload (``package.module:factory``): the same model, data and loss
trained by the loop a user writes with PyTorch best practice, in a fresh process.

The loop is the public peers' (``peers/loop.py``): bf16 autocast, ``AdamW(fused=True)``,
``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)``, ``torch.compile`` of the model (on a
GPU). What differs from fasttrain's rungs is only what the user would not have written: the
model is built by the workload's factory on the device under the same seed, one batch of its
data set is collated once and kept on the device (the peer measures the step, not the loader),
and the loss is the workload's summed loss divided by the batch's item count, as fasttrain's
loop divides it. The row is a ``kind: peer`` row like the public peers'.
"""
from __future__ import annotations

from typing import Any

import torch

from ..peers import _one_line, measure_into
from ..peers.loop import RECIPES, PeerSpec, precision_flags
from ..measure.rows import blank_row
from ..workloads import load_workload
from ..workloads.base import Workload


def is_user_workload(workload: str) -> bool:
    """A ``package.module:factory`` spec (not a registered name or a public model)."""
    from ..peers import peer_entry
    from ..workloads import PUBLIC, REGISTRY

    return (":" in workload and workload not in REGISTRY and peer_entry(workload) is None
            and workload.partition(":")[0] not in PUBLIC)


def build(wl: Workload, spec_name: str, batch: int, device: torch.device, seed: int) -> PeerSpec:
    """The workload's model on ``device`` (seeded as fasttrain builds it) and one batch of its
    data, with the loss a plain loop computes: the summed loss over the item count."""
    from ..run.data import to_device
    from ..run.loop import first_items, load_dataset

    torch.manual_seed(seed)
    with torch.device(device):
        model = wl.build_model()
    model = model.to(device).train()
    data = load_dataset(wl)
    batch_t = to_device(wl.collate(first_items(wl, data, batch)), device, False)
    count = wl.count(batch_t)
    units = float(count)  # one sync, before timing

    def loss(mods: dict) -> torch.Tensor:
        return wl.loss(mods["model"], batch_t) / count

    return PeerSpec(public=f"{spec_name} (your model, plain loop)", trainable=wl.trainable(model),
                    modules={"model": model}, loss=loss, batch=batch, units=int(units),
                    unit=f"{wl.unit}/s", info={"workload": spec_name, "unit": wl.unit})


def plain_peer_job(spec: Any) -> dict:
    """The ladder's peer rung for a user workload: ``spec`` is the ``run.child.ChildSpec``."""
    peer_recipe = spec.recipe.get("peer_recipe") or "bf16+compile"
    row = blank_row("peer", spec.workload, spec.size, f"peer {peer_recipe}",
                    peer=f"{spec.workload} {peer_recipe}", batch=spec.batch, steps=spec.steps,
                    applied={}, recipe={"peer_recipe": peer_recipe})
    try:
        recipe = RECIPES[peer_recipe]
        dev = torch.device(spec.device if spec.device not in (None, "auto") else
                           ("cuda" if torch.cuda.is_available() else "cpu"))
        wl = load_workload(spec.workload, spec.size, data=spec.data, **spec.options)
        batch = spec.batch or wl.default_batch
        compile_ = recipe.compile and dev.type != "cpu"
        with precision_flags(recipe):
            pspec = build(wl, spec.workload, batch, dev, seed=0)
            row.update(peer=f"{pspec.public} {peer_recipe}", batch=batch)
            measure_into(row, pspec, recipe, dev, spec.steps, spec.warmup, compile_, seed=0)
    except Exception as err:  # noqa: BLE001 — an error is a row, never an abort
        row["error"] = _one_line(err)
    return row
