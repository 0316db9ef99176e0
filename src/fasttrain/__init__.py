"""fasttrain: faster, leaner PyTorch training of transformer-style models — measured.

Public API (imported lazily so ``import fasttrain`` stays cheap):
``Recipe``, ``load_workload``, ``Workload``, ``SimpleWorkload``, ``train``, ``run_ladder``,
``convert`` (a timm or transformers model's classes swapped for fasttrain's layers, in place),
``Step`` (your own training loop's step, made fast), ``serve`` (a model prepared for inference
as a rung of the inference ladder: fused layers, GEMM epilogues, compile, CUDA graphs).
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Recipe": ("fasttrain.recipe", "Recipe"),
    "load_workload": ("fasttrain.workloads", "load_workload"),
    "Workload": ("fasttrain.workloads.base", "Workload"),
    "SimpleWorkload": ("fasttrain.workloads.base", "SimpleWorkload"),
    "train": ("fasttrain.run.loop", "train"),
    "run_ladder": ("fasttrain.ladder.runner", "run_ladder"),
    "FasttrainError": ("fasttrain.errors", "FasttrainError"),
    "convert": ("fasttrain.converters", "convert"),
    "Step": ("fasttrain.run.step", "Step"),
    "serve": ("fasttrain.inference.serve", "serve"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
