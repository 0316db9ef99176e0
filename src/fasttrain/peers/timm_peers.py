"""timm image classifiers as peers: ``timm.create_model(name, pretrained=False)``: the reference
workloads' ViT and Swin (``vit``, ``swin``), or any timm model named as ``timm:NAME`` (the peer of
the ``timm:NAME`` workload, built with the same kwargs: ``model_kwargs``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .loop import PeerSpec, package_version, require

MODELS = {
    ("vit", "base"): "vit_base_patch16_224",
    ("vit", "large"): "vit_large_patch16_224",
    ("swin", "base"): "swin_base_patch4_window7_224",
    ("swin", "large"): "swin_large_patch4_window7_224",
}
BATCH = {("vit", "base"): 128, ("vit", "large"): 64, ("swin", "base"): 64, ("swin", "large"): 32}
BATCH_BY_NAME = {MODELS[key]: batch for key, batch in BATCH.items()}

# Miniatures of the same timm classes, by family: the registered model's kwargs overridden.
TINY = {
    "vit": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10),
    # 56 px / patch 4 = 14 → stages at 14 and 7: window 7 divides both, shift happens at 14.
    "swin": dict(img_size=56, window_size=7, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10),
}


def family(name: str) -> str | None:
    """``vit`` or ``swin`` for a timm model of those families (they have miniatures)."""
    return next((f for f in TINY if name.startswith(f + "_")), None)


def model_kwargs(name: str, size: str, drop_path_rate: float) -> dict:
    """What ``timm.create_model(name, …)`` is given for the ``timm:NAME`` workload and its peer:
    ``base`` is the model as named, ``tiny`` a miniature of its classes; stochastic depth as
    asked (the workload's default: off)."""
    if size == "tiny":
        fam = family(name)
        if fam is None:
            raise ValueError(f"size tiny exists for timm's {', '.join(TINY)} models only; "
                             f"use --size base for {name}")
        return dict(TINY[fam], drop_path_rate=drop_path_rate)
    if size != "base":
        raise ValueError(f"timm models come in sizes base (as named) and tiny, not {size!r}")
    return {"drop_path_rate": drop_path_rate}


def build(workload: str, size: str, batch: int | None, device: torch.device, tiny: bool, recipe,
          options: dict | None = None) -> PeerSpec:
    """A timm model with random weights and one random batch of images and labels on ``device``."""
    timm = require("timm")
    if workload.startswith("timm:"):
        name = workload.split(":", 1)[1]
        kwargs = model_kwargs(name, "tiny" if tiny else size,
                              float((options or {}).get("drop_path_rate", 0.0)))
        batch = batch or (4 if tiny else BATCH_BY_NAME.get(name, 32))
    else:
        if (workload, size) not in MODELS:
            raise ValueError(f"peer {workload} has no size {size!r} (sizes: base, large)")
        name = MODELS[(workload, size)]
        kwargs = dict(TINY[workload]) if tiny else {"num_classes": 1000}
        batch = batch or (4 if tiny else BATCH[(workload, size)])
    model = timm.create_model(name, pretrained=False, **kwargs).to(device).train()
    image = int((getattr(model.patch_embed, "img_size", None) or (224,))[0]) \
        if hasattr(model, "patch_embed") else kwargs.get("img_size", 224)
    classes = getattr(model, "num_classes", kwargs.get("num_classes", 1000))
    images = torch.randn(batch, 3, image, image, device=device)  # (B, 3, H, W)
    labels = torch.randint(0, classes, (batch,), device=device)  # (B,)

    def loss(mods: dict) -> torch.Tensor:
        return F.cross_entropy(mods["model"](images), labels)

    return PeerSpec(
        public=f"timm:{name}" + ("(tiny)" if tiny else ""),
        trainable=model,
        modules={"model": model},
        loss=loss,
        batch=batch,
        units=batch,
        unit="img/s",
        info={"timm_model": name, "pretrained": False, "image_size": image, "kwargs": kwargs,
              "params": sum(p.numel() for p in model.parameters()), "timm": package_version("timm")},
    )
