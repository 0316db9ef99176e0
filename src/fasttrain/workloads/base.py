"""The Workload contract: what to train, on which data, with which loss.

A workload builds its model (called inside ``torch.device(device)`` after seeding, so weights
are created directly on the target device), provides a map-style Dataset whose items are dicts
of tensors, and computes the *summed* loss of a batch. The loop divides by the global number of
items in the optimizer step, so k accumulated micro-batches equal one big batch exactly, and
the reported loss is the mean per item.

What an item is, the workload says and fasttrain counts (:meth:`Workload.count`): a *sample* or
*image* is a row of the batch (the first dimension of ``count_field``, else of the first
tensor); a *token* is an element of ``count_field`` (else of the first tensor) that is not
``ignore_index``. The count is a device tensor, so a batch with another count (padding,
ignored labels) costs no host synchronisation and a captured CUDA graph follows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..errors import FasttrainError

Batch = dict[str, torch.Tensor]

SIZES = ("tiny", "base", "large")

UNITS = {"sample": "sample", "samples": "sample", "img": "img", "image": "img", "images": "img",
         "tok": "tok", "token": "tok", "tokens": "tok"}
"""Accepted spellings of an item → the unit rows use."""


def canonical_unit(unit: str) -> str:
    """The unit rows use for ``unit``; a ValueError naming the choices for another word."""
    try:
        return UNITS[unit]
    except (KeyError, TypeError):
        raise ValueError(f"unit {unit!r} is not one of sample, img, token") from None


class Workload:
    """Base class of every workload; subclasses override the methods below."""

    name: str = "workload"
    size: str = "tiny"
    unit: str = "sample"  # what an item is: sample, img, tok (throughput numerator, divisor)
    count_field: str | None = None  # the batch field whose items are counted (None: the first)
    ignore_index: int | None = None  # token entries equal to it are not items (labels: -100)
    default_batch: int = 8
    has_ema: bool = False  # the reference recipe keeps an EMA of the trainable module
    conv: bool = False  # channels_last is meaningful
    converts: bool = False  # a public model the converters reach: the ladder has a convert rung
    reference_lr: float = 1e-4  # the learning rate of a recipe that leaves lr at 0
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
        try:
            return default_collate(items)
        except RuntimeError as err:
            if "stack expects each tensor to be equal size" not in str(err):
                raise
            raise FasttrainError(uneven(items)) from None

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Summed loss over the items of ``batch`` (a 0-dim tensor)."""
        return model(**batch)

    def count(self, batch: Batch) -> int | torch.Tensor:
        """Items in a batch, the divisor of the summed loss: rows of ``count_field`` for samples
        and images; its entries other than ``ignore_index`` for tokens (a 0-dim tensor, counted
        on the batch's device without a host sync)."""
        if self.count_field is None:
            field_ = next(iter(batch.values()))
        elif self.count_field in batch:
            field_ = batch[self.count_field]
        else:
            raise ValueError(f"count_field {self.count_field!r} is not in the batch "
                           f"(fields: {', '.join(batch)})")
        if canonical_unit(self.unit) != "tok":
            return int(field_.shape[0])
        if self.ignore_index is None:
            return field_.numel()
        return (field_ != self.ignore_index).sum()

    def batch_of(self, batch: int) -> int:
        """The global batch a recipe's ``batch`` means (0: this workload's own)."""
        return batch or self.default_batch

    def lr_of(self, lr: float) -> float:
        """The learning rate a recipe's ``lr`` means (0: this workload's reference rate)."""
        return lr or self.reference_lr

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


def uneven(items: list) -> str:
    """What a batch of items of different shapes is told: the field, two of its shapes, and
    the way out."""
    fields = items[0].keys() if isinstance(items[0], Mapping) else None
    for key in fields or ():
        if not all(isinstance(it.get(key), torch.Tensor) for it in items):
            continue
        shapes = sorted({tuple(it[key].shape) for it in items})
        if len(shapes) > 1:
            return (f"the data set's field {key!r} holds items of shapes {shapes[0]} and "
                    f"{shapes[1]}: batches stack items of one shape; give items of one shape, "
                    f"or pad_fields={{{key!r}: PAD}} in the SimpleWorkload (1-D fields padded on "
                    "the right to the batch's longest)")
    return ("the data set's items differ in shape: batches stack items of one shape; give "
            "items of one shape (dicts of tensors), or pad_fields in the SimpleWorkload")


@dataclass
class SimpleWorkload(Workload):
    """A user's own model as a workload, without subclassing.

    ``loss_fn(model, batch)`` must return the loss *summed* over the batch's items, or set
    ``loss_is_mean=True`` and the mean is scaled by the item count. ``unit`` says what an item
    is (``sample``, ``img`` or ``token``); tokens are counted in ``count_field`` (default: the
    batch's first field), skipping ``ignore_index``.
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
    count_field: str | None = None
    ignore_index: int | None = None
    pad_fields: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.unit = canonical_unit(self.unit)
        if self.ignore_index is not None and self.unit != "tok":
            raise ValueError(f"ignore_index applies to token counts; unit is {self.unit!r} "
                             "(set unit='token')")
        if not callable(self.build) or isinstance(self.build, nn.Module):
            raise ValueError(f"build must be a callable returning the model, not "
                             f"{type(self.build).__name__}")

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
