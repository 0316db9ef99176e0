"""What a converter is, and the registry that finds one for a module by its class.

A converter recognises one public module class (by the class's import path, so the library is
never imported to look: a model without timm converts nothing and imports no timm) and turns such
a module, in place, into a fasttrain layer that computes the same function and carries a fused
path. The swap changes the module's class and sets the few attributes the fasttrain layer
reads; it never creates or renames a parameter or a persistent buffer, so the module's state
dict keys, shapes and dtypes stay what the library made (pretrained weights and checkpoints load
either way), and the parameter objects stay the same ones (an optimizer built before still
holds them).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Converter:
    """One public module class → one fasttrain layer."""

    name: str
    """Short name of what it converts, for reports: ``timm ViT Block``."""
    sources: tuple[str, ...]
    """Import paths (``module.QualName``) of the public class, in every library version that
    defines it in a different module. Empty: a converter that recognises a module of any
    class by what it holds (``candidate``), tried where no converter names the class."""
    becomes: str
    """What the module becomes, in words."""
    unsupported: Callable[[nn.Module], str | None]
    """Why this module's configuration cannot be converted (None: it can)."""
    swap: Callable[[nn.Module], None]
    """Turns the module into the fasttrain layer, in place."""
    sample: Callable[[nn.Module, torch.Generator], tuple[tuple, dict] | None] | None = None
    """Positional and keyword inputs for the numeric self-check (tensors made on the CPU from the
    generator): the converted module must give the original's output on them. None: no
    self-check of its own; the sample None: none for this module (its input is not known from
    its configuration)."""
    candidate: Callable[[nn.Module], bool] | None = None
    """Whether a module of the class is one this converter is about at all (None: every one):
    one that is not is passed over without a word (an ``nn.Sequential`` without a Linear →
    GELU pair), where ``unsupported`` reports a reason."""
    differs: str = "numeric self-check failed"
    """What a self-check that finds another output says (before the largest difference): for a
    converter that recognises modules by structure, that the module computes something else."""

    @property
    def by_structure(self) -> bool:
        """Whether it recognises modules by what they hold (``sources`` empty), not by class."""
        return not self.sources


SAMPLE_TOKENS = 7  # tokens of a self-check's sample sequence


def sequence_sample(width_of: Callable[[nn.Module], int]):
    """A self-check's sample: one sequence of ``SAMPLE_TOKENS`` tokens of the module's width."""
    def sample(module: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
        return (torch.randn(1, SAMPLE_TOKENS, width_of(module), generator=gen),), {}
    return sample


_MODULES = ("timm_vit", "timm_swin", "hf_llama", "diffusers_sd", "torch_nn", "torch_blocks")
"""The modules that define converters (``CONVERTERS`` in each), imported on first use."""


def class_path(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _all() -> list[Converter]:
    return [conv for name in _MODULES
            for conv in importlib.import_module(f"{__package__}.{name}").CONVERTERS]


def registry() -> dict[str, Converter]:
    """Every converter that names its classes, keyed by each import path it recognises."""
    return {source: conv for conv in _all() for source in conv.sources}


def structural() -> tuple[Converter, ...]:
    """The converters that recognise a module by what it holds, not by its class."""
    return tuple(conv for conv in _all() if conv.by_structure)


def list_converters() -> dict[str, str]:
    """Converter names and what each module becomes."""
    return {c.name: c.becomes for c in _all()}


def concerns(conv: Converter, module: nn.Module) -> bool:
    """Whether ``module`` is one ``conv`` is about (``Converter.candidate``)."""
    return conv.candidate is None or conv.candidate(module)


class Finder:
    """The converter for a module, if any: the one that names its class, else the first that
    recognises it by structure; either only where it is about the module (``candidate``)."""

    def __init__(self, table: dict[str, Converter], structural: tuple[Converter, ...]) -> None:
        self.table, self.structural = table, structural

    def __call__(self, module: nn.Module) -> Converter | None:
        conv = self.table.get(class_path(module))
        if conv is not None:
            return conv if concerns(conv, module) else None
        return next((c for c in self.structural if concerns(c, module)), None)


LIBRARY = "_fasttrain_library_class"  # the instance attribute holding the class it was


def remember(m: nn.Module) -> None:
    """Keep the library class on the instance, for the calls the converted class hands back."""
    if LIBRARY not in m.__dict__:
        m.__dict__[LIBRARY] = type(m)


_MIXED: dict[tuple[type, type], type] = {}


def swap_keeping_library(m: nn.Module, converted: type) -> None:
    """Make ``m`` a subclass of both ``converted`` (its forward) and its library class (every
    other method: ``generate``, ``save_pretrained``, gradient checkpointing's ``__call__``), so
    the module stays what the library and its users check for (``isinstance``)."""
    remember(m)
    m.__class__ = mixed_class(converted, m.__dict__[LIBRARY])


def mixed_class(converted: type, library: type) -> type:
    """The class with ``converted``'s forward and ``library``'s everything else, made once."""
    key = (converted, library)
    if key not in _MIXED:
        _MIXED[key] = type(converted.__name__, (converted, library),
                           {"__module__": converted.__module__,
                            "__qualname__": converted.__qualname__,
                            "__reduce_ex__": _reduce_mixed})
    return _MIXED[key]


def _new_mixed(converted: type, library: type) -> nn.Module:
    return object.__new__(mixed_class(converted, library))


def _reduce_mixed(self: nn.Module, protocol: int):
    """Pickling (``torch.save(model)``, ``copy``): a made class has no importable name, so it is
    rebuilt from the two it was made of, which have."""
    converted, library = type(self).__bases__
    return _new_mixed, (converted, library), self.__dict__.copy()


def library_forward(m: nn.Module, *args, **kwargs):
    return m.__dict__[LIBRARY].forward(m, *args, **kwargs)
