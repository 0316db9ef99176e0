"""Your own training loop with fasttrain's fused kernels: a timm model converted in place.

    python -m examples.convert_own_loop

``fasttrain.convert`` swaps timm's ViT/Swin classes for fasttrain layers that compute the same
function, keeps every parameter (names, shapes, the objects themselves), and switches on the
fused Triton kernels asked for. Nothing else in the loop changes. On a GPU the kernels run
compiled; on a CPU they stay on the plain path and the report says why.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def main(steps: int = 3, convert: bool = True, model_name: str = "vit_base_patch16_224",
         batch: int = 8, device: str | None = None, **timm_kwargs) -> tuple[list[float], str]:
    """Train ``steps`` steps on random images; returns the losses and what convert did."""
    import timm

    import fasttrain

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False, **timm_kwargs).to(device)
    report = fasttrain.convert(model, kernels="fused").summary() if convert else "not converted"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    step_model = torch.compile(model) if device == "cuda" else model
    size = model.patch_embed.img_size
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        images = torch.randn(batch, 3, *size, generator=gen).to(device)
        labels = torch.randint(0, model.num_classes, (batch,), generator=gen).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(step_model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, report


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", [round(x, 4) for x in losses])
