"""The Workload contract: what to train, on which data, with which loss.

A workload builds its model (called inside ``torch.device(device)`` after seeding, so weights
are created directly on the target device), provides a map-style Dataset whose items are dicts
of tensors, and computes the *summed* loss of a batch. The loop divides by the global number of
items (images or tokens) in the optimizer step, so k accumulated micro-batches equal one big
batch exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

Batch = dict[str, torch.Tensor]

SIZES = ("tiny", "base", "large")


class Workload:
    """Base class of every workload; subclasses override the methods below."""

    name: str = "workload"
    size: str = "tiny"
    unit: str = "sample"  # throughput numerator: img, tok, sample
    default_batch: int = 8
    has_ema: bool = False  # the reference recipe keeps an EMA of the trainable module
    conv: bool = False  # channels_last is meaningful
    converts: bool = False  # a public model the converters reach: the ladder has a convert rung
    reference_lr: float = 1e-4  # the learning rate of a recipe that leaves lr at 0
    # Every batch of the same size holds the same number of items (no padding/ignored labels):
    # the loop counts once instead of syncing every step. SimpleWorkload counts every step.
    constant_count: bool = True
    compile_scope: str = "model"  # what the ladder's compile rung compiles: model | regional
    # attention backends besides the ladder's "auto" that the fast preset search should measure
    attention_candidates: tuple[str, ...] = ()
    # Fields whose length varies between items, with their pad values (e.g. token ids 0, labels
    # -100): such batches are padded on the right (see the pad_multiple switch).
    pad_fields: Mapping[str, int] = MappingProxyType({})

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def dataset(self) -> Dataset:
        raise NotImplementedError

    def collate(self, items: list[Batch]) -> Batch:
        if self.pad_fields:
            from .data import pad_collate

            return pad_collate(items, dict(self.pad_fields))
        return default_collate(items)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Summed loss over the items of ``batch`` (a 0-dim tensor)."""
        return model(**batch)

    def count(self, batch: Batch) -> int:
        """Items (images or tokens) in a batch: the divisor of the summed loss."""
        first = next(iter(batch.values()))
        return int(first.shape[0])

    def trainable(self, model: nn.Module) -> nn.Module:
        """The module the optimizer, grad clipping and EMA see (SD: the UNet only)."""
        return model

    def regional_blocks(self, model: nn.Module) -> list[nn.Module]:
        """Repeated blocks for regional compile and checkpointing; default: ModuleList items."""
        return repeated_blocks(model)

    def describe(self) -> dict[str, Any]:
        return {"workload": self.name, "size": self.size, "unit": self.unit}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Items of the outermost ``nn.ModuleList``s (transformer layers, UNet stages)."""
    found: list[nn.Module] = []
    taken: set[str] = set()
    for name, mod in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(mod, nn.ModuleList):
            found.extend(mod)
            taken.add(name)
    return found


@dataclass
class SimpleWorkload(Workload):
    """A user's own model as a workload, without subclassing.

    ``loss_fn(model, batch)`` must return the loss *summed* over the batch's items, or set
    ``loss_is_mean=True`` and the mean is scaled by the item count.
    """

    name: str = "user"
    build: Callable[[], nn.Module] = field(default=lambda: nn.Identity())
    data: Callable[[], Dataset] | Dataset | None = None
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    unit: str = "sample"
    default_batch: int = 8
    loss_is_mean: bool = False
    blocks: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    size: str = "custom"
    constant_count: bool = False

    def build_model(self) -> nn.Module:
        return self.build()

    def dataset(self) -> Dataset:
        if self.data is None:
            raise ValueError(f"workload {self.name!r} has no data")
        return self.data() if callable(self.data) and not isinstance(self.data, Dataset) else self.data

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = self.loss_fn(model, batch) if self.loss_fn else model(**batch)
        return out * self.count(batch) if self.loss_is_mean else out

    def regional_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(self.blocks(model)) if self.blocks else repeated_blocks(model)
