"""timm on the CPU machines: its wheels need torchvision, whose wheels do not load on the CPU
build of torch used here. timm's ViT and Swin need none of torchvision's code at model-building
time, so a meta-path finder answers every ``torchvision`` import with an empty package module.
Installed only in a test process that lacks a working torchvision (the GPU machine has one)."""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _EmptyPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr: _attribute(spec.name, attr)
        return mod

    def exec_module(self, module):
        pass


class _Anything(type):
    """A class whose every attribute is another such class (``InterpolationMode.NEAREST``)."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")


def _attribute(module: str, attr: str):
    if attr.startswith("__"):  # __file__, __spec__…: absent, as for a namespace package
        raise AttributeError(attr)
    return _placeholder(f"{module}.{attr}")


@functools.lru_cache(maxsize=None)
def _placeholder(name: str):
    """Any name timm reads from torchvision at import (InterpolationMode, transforms…)."""
    return _Anything(name.rsplit(".", 1)[-1], (), {"__qualname__": name})


def import_timm():
    """timm, with the stub standing in for torchvision where torchvision does not import;
    None where timm is not installed."""
    if importlib.util.find_spec("timm") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 — missing, or wheels that do not load on this torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        if not any(isinstance(f, _EmptyPackages) for f in sys.meta_path):
            _before_the_stub()
            sys.meta_path.insert(0, _EmptyPackages())
    import timm

    return timm


def _before_the_stub() -> None:
    """diffusers and transformers note which packages exist (diffusers at import, transformers
    at its first question, cached), and would otherwise find the stub's torchvision and read a
    version no package metadata gives ("N/A", which their version checks refuse): let them take
    their note while torchvision is really absent."""
    if importlib.util.find_spec("diffusers") is not None:
        importlib.import_module("diffusers.utils.import_utils")
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.utils.import_utils").is_torchvision_available()
