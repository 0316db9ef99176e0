"""Workload registry: a registered name (``vit``), a public model (``timm:NAME``, ``hf:llama``,
``diffusers:sd-v1``)
or a user's ``package.module:factory``.

A factory is called as ``factory(size=..., seed=..., data=..., **options)`` and returns a
:class:`~fasttrain.workloads.base.Workload`. Registered factories are imported lazily, so
importing fasttrain never builds a model.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Any

from ..errors import FasttrainError, describe_error
from ..recipe import switch_value
from .base import SIZES, SimpleWorkload, Workload

REGISTRY: dict[str, str] = {
    "vit": "fasttrain.workloads.vit:make",
    "swin": "fasttrain.workloads.swin:make",
    "sd": "fasttrain.workloads.sd:make",
    "llama": "fasttrain.workloads.llama:make",
}

# public models: ``prefix:NAME`` calls the factory with ``model=NAME``
PUBLIC: dict[str, str] = {
    "timm": "fasttrain.workloads.timm_models:make",
    "hf": "fasttrain.workloads.hf_models:make",
    "diffusers": "fasttrain.workloads.diffusers_models:make",
}

__all__ = ["PUBLIC", "REGISTRY", "SIZES", "SimpleWorkload", "Workload", "load_workload"]


def _factory(spec: str):
    prefix, _, name = spec.partition(":")
    if prefix in PUBLIC:
        if not name:
            raise FasttrainError(f"workload {spec!r}: name the model, e.g. timm:vit_base_patch16_224")
        return functools.partial(_factory(PUBLIC[prefix]), model=name)
    target = REGISTRY.get(spec, spec)
    if ":" not in target:
        raise FasttrainError(
            f"unknown workload {spec!r}: use one of {', '.join(REGISTRY)} or package.module:factory")
    mod_name, fn_name = target.split(":", 1)
    if not mod_name or not fn_name:
        raise FasttrainError(f"workload {spec!r}: give package.module:factory (both parts)")
    if "/" in mod_name or os.sep in mod_name or mod_name.endswith(".py"):
        dotted = mod_name.removesuffix(".py").strip("/").replace(os.sep, ".").replace("/", ".")
        raise FasttrainError(f"workload {spec!r} is a file path: give a module path, e.g. "
                             f"{dotted}:{fn_name}, from the folder that holds it")
    if spec not in REGISTRY:
        _importable_here()
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        hint = ("; run from the folder that holds it, or add that folder to PYTHONPATH"
                if missing and mod_name.split(".")[0] == missing.split(".")[0] else "")
        raise FasttrainError(f"workload {spec!r}: cannot import {mod_name!r} ({err}){hint}"
                             ) from None
    except Exception as err:  # a user's module that fails as it loads: a mistake of theirs
        if spec in REGISTRY or mod_name.startswith("fasttrain."):
            raise  # fasttrain's own module: a bug of ours keeps its traceback
        where = f" ({err.filename}, line {err.lineno})" if isinstance(err, SyntaxError) else ""
        raise FasttrainError(f"workload {spec!r}: importing {mod_name!r} raised "
                             f"{type(err).__name__}: {getattr(err, 'msg', None) or err}{where}; "
                             "fix the module") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise FasttrainError(f"workload {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def _importable_here() -> None:
    """A user's ``package.module:factory`` resolves against the current folder first, as
    ``python -m`` does (the folder a command runs from need not be installed or on PYTHONPATH)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def _expected(param: inspect.Parameter) -> tuple[str | None, bool]:
    """The simple type a factory parameter asks for (``bool``, ``int``, ``float`` or None for
    anything else), from its annotation or else its default; and whether it takes None."""
    ann, empty = param.annotation, inspect.Parameter.empty
    if ann is empty:  # no annotation: the default's type says it
        default = param.default
        text = None if default is empty or default is None else type(default).__name__
    elif isinstance(ann, str):
        text = ann
    elif isinstance(ann, type):
        text = ann.__name__
    else:  # typing objects: Optional[bool], int | None
        text = str(ann)
    text = (text or "").replace("typing.", "").replace(" ", "")
    optional = text.startswith("Optional[") and text.endswith("]")
    if optional:
        text = text[len("Optional["):-1]
    parts = set(text.split("|")) if text else set()
    takes_none = optional or "None" in parts or param.default is None
    kinds = parts - {"None", "NoneType"}
    return (next(iter(kinds)) if len(kinds) == 1 and kinds <= {"bool", "int", "float"}
            else None), takes_none


def _coerce(spec: str, name: str, param: inspect.Parameter, value: Any) -> Any:
    """An ``--opt`` value as the factory's parameter asks for it: ``false`` is False for a
    ``bool`` (a non-empty string would be true), a number for an ``int``/``float``; anything
    that does not fit is one line naming the option."""
    kind, takes_none = _expected(param)
    if kind is None or (value is None and takes_none):
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if (on := switch_value(str(value))) is not None:
            return on
        raise FasttrainError(f"workload {spec!r}: option {name!r} is a switch, got {value!r}: "
                             "give true or false")
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    wanted = ("an integer" if kind == "int" else "a number") + (" or None" if takes_none else "")
    raise FasttrainError(f"workload {spec!r}: option {name!r} takes {wanted}, got {value!r}")


def load_workload(spec: str, size: str = "tiny", seed: int = 0, data: str | None = None,
                  **options: Any) -> Workload:
    """Build the workload named ``spec`` (registry name or ``module:factory``)."""
    fn = _factory(spec)
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if k not in params and not takes_all]
    if unknown:
        raise FasttrainError(f"workload {spec!r} has no option {unknown[0]!r}")
    options = {k: _coerce(spec, k, params[k], v) if k in params else v for k, v in options.items()}
    kwargs = {k: v for k, v in {"size": size, "seed": seed, "data": data, **options}.items()
              if k in params or takes_all}
    if spec in REGISTRY and size not in SIZES:
        raise FasttrainError(f"unknown size {size!r} for {spec!r}: use one of {', '.join(SIZES)}")
    try:
        wl = fn(**kwargs)
    except FasttrainError:
        raise
    except (ValueError, OSError) as err:
        raise FasttrainError(f"workload {spec!r}: {err}") from None
    except Exception as err:  # a bug in a user's factory: one line naming it, not a traceback
        if spec in REGISTRY or spec.partition(":")[0] in PUBLIC:
            raise  # fasttrain's own factory: a bug of ours keeps its traceback
        raise FasttrainError(f"workload {spec!r}: its factory raised {describe_error(err)}; "
                             "fix the factory") from None
    if not isinstance(wl, Workload):
        raise FasttrainError(f"workload {spec!r}: factory returned {type(wl).__name__}, not a Workload")
    return wl
