"""A public model's weights from a ``.safetensors`` file (``weights=`` of the ``timm:`` and ``hf:``
workloads): keys and shapes checked from the file's header before anything loads, a tied
weight accepted under any of its names, nothing pickled ever loaded."""
from __future__ import annotations

from pathlib import Path

from torch import nn


def check_weights(model: nn.Module, path: str) -> None:
    """That ``path`` is a ``.safetensors`` file whose keys and shapes are ``model``'s state
    dict's (read from the file's header; ``model`` may live on the meta device)."""
    file = Path(path)
    if file.suffix != ".safetensors":
        raise ValueError(f"weights {path}: give a .safetensors file (a pickled checkpoint "
                         "runs code when loaded)")
    if not file.is_file():
        raise FileNotFoundError(f"weights {path}: no such file")
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 — not a safetensors file after all
        raise ValueError(f"weights {path}: not a readable .safetensors file ({err})") from None
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = tied_names(model)
    missing = [k for k in own if k not in shapes and not tied.get(k, set()) & shapes.keys()]
    unexpected = [k for k in shapes if k not in own]
    other = [k for k in own if k in shapes and shapes[k] != own[k]]
    if missing or unexpected or other:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        parts = [f"{len(missing)} keys missing ({few(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({few(unexpected)})" if unexpected else "",
                 f"{len(other)} of another shape ({few(other)})" if other else ""]
        raise ValueError(f"weights {path} do not match {type(model).__name__}: "
                         + "; ".join(p for p in parts if p))


def tied_names(model: nn.Module) -> dict[str, set[str]]:
    """Each name of a parameter shared under several names (a tied LM head and embedding) → its
    other names: a checkpoint holds such a weight once (as transformers saves it)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: set(group) - {n} for group in names.values() if len(group) > 1 for n in group}


def load_weights(model: nn.Module, path: str) -> None:
    """A ``.safetensors`` state dict into ``model``, every key and shape checked first (a tied
    weight may be there under one of its names)."""
    check_weights(model, path)
    from safetensors.torch import load_file

    state = load_file(str(path))
    for name, others in tied_names(model).items():
        if name not in state:
            state[name] = state[next(o for o in sorted(others) if o in state)]
    model.load_state_dict(state)
