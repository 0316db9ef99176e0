"""timm image classifiers as workloads: ``timm:vit_base_patch16_224``, ``timm:swin_base_…``.

The model is ``timm.create_model(name, pretrained=False, **kwargs)`` (no download, ever), with
random weights or ``weights=FILE`` (a ``.safetensors`` state dict of the timm model, loaded with
every key checked). It trains on the reference workloads' image pipeline (the user's folder via
``--data``, else synthetic JPEGs): uint8 crops, normalised on the device in the model's dtype,
cross-entropy summed. The ``convert`` switch turns its timm blocks into fasttrain layers, and the
ladder's peer is the same timm model under PyTorch best practice.

Stochastic depth is off unless asked for (``drop_path_rate``; timm's Swin defaults to 0.1):
its random branch drops differ between eager and compiled rungs, which the loss parity check
against the fp32 rung would read as a numerical change. The peer takes the same setting.
Sizes: ``base`` is the named model as timm defines it; ``tiny`` is a miniature of the same
classes (ViT and Swin families) for tests.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..peers.timm_peers import BATCH_BY_NAME, family, model_kwargs
from .base import Workload
from .data import ImageFiles, classification_images, normalize_images

def import_timm():
    try:
        import timm
    except ImportError as err:
        raise ValueError(f"timm workloads need timm (pip install timm): {err}") from None
    return timm


class ImageClassifier(nn.Module):
    """A public image classifier trained on uint8 image batches: normalised on the device in the
    dtype of the model's norms (bf16 under bf16-true), cross-entropy summed over the batch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.channels_last = False  # set by the channels_last technique

    def input_dtype(self) -> torch.dtype:
        for m in self.model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                return m.weight.dtype
        return next(self.model.parameters()).dtype

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = normalize_images(images, self.input_dtype(), self.channels_last)
        return F.cross_entropy(self.model(x).float(), labels, reduction="sum")


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


class TimmWorkload(Workload):
    unit, conv, converts = "img", True, True

    def __init__(self, model: str, size: str, seed: int, data: str | None,
                 weights: str | None, drop_path_rate: float):
        timm = import_timm()
        if not timm.is_model(model.split(".")[0]):
            raise ValueError(f"timm has no model {model!r} (timm.list_models() lists them)")
        self.model_name, self.size, self.seed, self.data_dir = model, size, seed, data
        self.weights = weights
        self.kwargs = model_kwargs(model, size, float(drop_path_rate))
        self.name = f"timm:{model}"
        with torch.device("meta"):
            probe = timm.create_model(model, pretrained=False, **self.kwargs)
        if weights is not None:
            check_weights(probe, weights)
        img = getattr(getattr(probe, "patch_embed", None), "img_size", None) or (224, 224)
        self.image, self.classes = int(img[0]), int(probe.num_classes)
        self.default_batch = 8 if size == "tiny" else BATCH_BY_NAME.get(model, 32)
        if family(model) == "swin":
            self.attention_candidates = ("math",)  # 49-token windows: see workloads/swin.py

    def build_model(self) -> nn.Module:
        model = import_timm().create_model(self.model_name, pretrained=False, **self.kwargs)
        if self.weights is not None:
            load_weights(model, self.weights)
        return ImageClassifier(model)

    def dataset(self) -> ImageFiles:
        return classification_images(self.data_dir, self.image, self.classes,
                                     tiny=self.size == "tiny", seed=self.seed)

    def regional_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The items of every ``blocks`` stack (ViT's one, each Swin stage's)."""
        return [b for name, m in model.named_modules()
                if name.split(".")[-1] == "blocks" and isinstance(m, (nn.Sequential, nn.ModuleList))
                for b in m]

    def describe(self) -> dict:
        return {**super().describe(), "timm_model": self.model_name, "timm_kwargs": self.kwargs,
                "weights": self.weights, "timm": import_timm().__version__}


def make(model: str, size: str = "tiny", seed: int = 0, data: str | None = None,
         weights: str | None = None, drop_path_rate: float = 0.0) -> TimmWorkload:
    return TimmWorkload(model, size, seed, data, weights, drop_path_rate)
