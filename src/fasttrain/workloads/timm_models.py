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

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import missing_dependency
from ..peers.timm_peers import BATCH_BY_NAME, family, model_kwargs
from .base import Workload
from .weights import check_weights, load_weights
from .data import ImageFiles, classification_images, normalize_images

def import_timm():
    try:
        import timm
    except ModuleNotFoundError as err:
        if dep := missing_dependency("timm", err):  # torchvision, typically
            raise ValueError(f"timm workloads need timm, which needs {dep} (not installed: "
                             f"pip install {dep})") from None
        raise ValueError("timm workloads need timm (not installed: pip install timm)") from None
    except ImportError as err:
        raise ValueError(f"timm workloads need timm, which failed to import: {err}") from None
    return timm


class ImageClassifier(nn.Module):
    """A public image classifier trained on uint8 image batches: normalised on the device in the
    dtype of the model's norms (bf16 under bf16-true), cross-entropy summed over the batch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.channels_last = False  # set by the channels_last technique
        # the norm whose dtype the inputs take, found once (not a walk of the model every step)
        self._dtype_from = next((name for name, m in model.named_modules()
                                 if isinstance(m, nn.LayerNorm) and m.weight is not None), None)

    def input_dtype(self) -> torch.dtype:
        if self._dtype_from is None:
            return next(self.model.parameters()).dtype
        return self.model.get_submodule(self._dtype_from).weight.dtype

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = normalize_images(images, self.input_dtype(), self.channels_last)
        return F.cross_entropy(self.model(x).float(), labels, reduction="sum")


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
