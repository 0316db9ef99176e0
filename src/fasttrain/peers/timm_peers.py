"""timm image classifiers (ViT, Swin) as peers: ``timm.create_model(name, pretrained=False)``."""
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

# Miniatures of the same timm classes, built by overriding the registered model's kwargs.
TINY = {
    "vit": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10),
    # 56 px / patch 4 = 14 → stages at 14 and 7: window 7 divides both, shift happens at 14.
    "swin": dict(img_size=56, window_size=7, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10),
}


def build(workload: str, size: str, batch: int | None, device: torch.device, tiny: bool, recipe) -> PeerSpec:
    """A timm model with random weights and one random batch of images and labels on ``device``."""
    timm = require("timm")
    if (workload, size) not in MODELS:
        raise ValueError(f"peer {workload} has no size {size!r} (sizes: base, large)")
    name = MODELS[(workload, size)]
    kwargs = dict(TINY[workload]) if tiny else {"num_classes": 1000}
    batch = batch or (4 if tiny else BATCH[(workload, size)])
    model = timm.create_model(name, pretrained=False, **kwargs).to(device).train()
    image = kwargs.get("img_size", 224)
    classes = kwargs["num_classes"]
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
