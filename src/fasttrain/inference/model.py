"""The forward-only model of a workload, prepared as one rung asks.

``Classifier`` turns a workload's training model (images and labels in, summed loss out) into
what is served: a batch of images in, logits ``(B, classes)`` out — for timm's and fasttrain's
own models uint8 images ``(B, H, W, 3)`` with the normalisation inside, so that every rung, the
peers and the exported package take the same input.
``prepare`` applies a rung to it in a fixed order — dtype and device → attention → fasttrain's
layers → quantized linears → GEMM epilogues → the last block on the head's tokens → compile →
fasttrain's own CUDA graphs — and says what each step did.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import FasttrainError
from ..workloads.base import Workload
from ..workloads.data import normalize_images
from .spec import InferRung


class Classifier(nn.Module):
    """A batch of images → logits (B, classes), forward only.

    timm's models (inside the workloads' ImageClassifier) and fasttrain's own ViT and Swin take
    uint8 images (B, H, W, 3) and normalise them inside. A model of your own (a ``module:function``
    workload counting images) takes the images its data set gives, a floating-point batch cast
    to ``input_dtype`` (the rung's dtype, set by ``prepare``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        from ..workloads.swin import Swin
        from ..workloads.vit import ViT

        self.model = model
        self.input_dtype = torch.float32
        # A timm model sits inside the workloads' ImageClassifier (.model); fasttrain's own
        # ViT and Swin give logits as head(features(images)) and normalise inside features.
        self.timm = model.model if hasattr(model, "input_dtype") else None
        self.own = isinstance(model, (ViT, Swin))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.timm is not None:
            return self.timm(normalize_images(images, self.model.input_dtype()))
        if self.own:
            return self.model.head(self.model.features(images))
        if images.is_floating_point():
            images = images.to(self.input_dtype)
        return self.model(images)


def require_classifier(wl: Workload, name: str) -> None:
    """``fasttrain infer`` serves image classifiers: a workload of another unit is refused."""
    if wl.unit != "img":
        raise FasttrainError(f"fasttrain infer serves image classifiers; {name} is not one "
                             f"(it counts {'tokens' if wl.unit == 'tok' else wl.unit + 's'}; use "
                             "timm:…, vit, swin or a module:function workload of unit img)")


def load_classifier(wl: Workload, checkpoint: str | None = None) -> Classifier:
    """The workload's model (its weights, or the model weights of a ``fasttrain train --save``
    folder) as a :class:`Classifier`, in eval mode, on the CPU in fp32."""
    require_classifier(wl, wl.name)
    torch.manual_seed(getattr(wl, "seed", 0))
    model = wl.build_model()
    if checkpoint is not None:
        from ..run.checkpoint import model_weights

        weights = model_weights(checkpoint, wl)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            name = (missing or unexpected)[0]
            raise FasttrainError(f"checkpoint {checkpoint} does not fit {wl.name} {wl.size}: "
                                 f"{'missing' if missing else 'unexpected'} weight {name!r}")
    return Classifier(model).eval()


def set_attention(model: nn.Module, fused: bool) -> str:
    """Switch the library's attention modules (timm's ``fused_attn``) to SDPA or to attention
    written out; what it did, in words."""
    mods = [m for m in model.modules() if hasattr(m, "fused_attn")]
    if not mods:
        return "attention as the model computes it (no fused_attn switch)"
    for m in mods:
        m.fused_attn = fused
    return f"{'SDPA' if fused else 'written-out'} attention in {len(mods)} modules"


def prepare(model: nn.Module, rung: InferRung, device: torch.device) -> tuple[nn.Module, dict]:
    """``model`` prepared as ``rung`` asks, and what each step did (the row's ``applied``).
    The peers keep the library's attention setting and get only dtype and compile."""
    applied: dict[str, Any] = {}
    model = model.to(device=device, dtype=getattr(torch, rung.dtype))
    if isinstance(model, Classifier):  # a model of your own takes its float input in this dtype
        model.input_dtype = getattr(torch, rung.dtype)
    if rung.peer is None and rung.fused_attention is not None:
        applied["attention"] = set_attention(model, rung.fused_attention)
    if rung.convert:
        from ..converters.apply import convert

        report = convert(model, kernels="fused" if device.type == "cuda" else "none")
        applied["convert"] = report.summary()
        if report.skipped:
            applied["convert_skipped"] = report.skipped_lines()
        from ..layers.windows import freeze_window_biases

        if frozen := freeze_window_biases(model):
            applied["window_bias"] = (f"relative-position bias and shift mask summed once for "
                                      f"{frozen} window attention layers, not at every call")
    if rung.quant:
        from .quant import quantize_linears, sensitive_layers

        report = quantize_linears(model, rung.quant, keep=sensitive_layers(model))
        applied["quant"] = report.summary()
    if rung.gelu_epilogue:
        from ..layers.mlp import use_gelu_epilogue

        applied["epilogue"] = "; ".join(use_gelu_epilogue(model))
    if rung.head_tokens:
        from .head_tokens import keep_head_tokens

        applied["head_tokens"] = keep_head_tokens(model)
    for p in model.parameters():
        p.requires_grad_(False)
    if rung.compile:
        applied["compile"] = rung.compile
        mode = None if rung.compile == "default" else rung.compile
        model = torch.compile(model, mode=mode, dynamic=False)
    if rung.capture:
        from .capture import CapturedForward

        return CapturedForward(model, applied), applied
    return model, applied


def check_device(rung: InferRung, device: torch.device) -> str | None:
    """Why ``rung`` cannot run on ``device`` (its skip reason), or None."""
    if rung.cuda_only and device.type != "cuda":
        return "needs a CUDA GPU"
    if "sm89" in rung.requires and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 matmuls need an Ada or Hopper GPU (sm89+)"
    if device.type == "cpu" and rung.dtype == "float16" and rung.compile:
        return "fp16 compiled on a CPU is not a configuration worth measuring"
    return None

