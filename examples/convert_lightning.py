"""Lightning with fasttrain's fused kernels: a timm model converted in place inside a
``LightningModule``.

    python -m examples.convert_lightning
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def main(steps: int = 3, convert: bool = True, model_name: str = "vit_base_patch16_224",
         batch: int = 8, **timm_kwargs) -> tuple[list[float], str]:
    """Train ``steps`` steps with ``lightning.Trainer``; returns the losses and what convert did."""
    import lightning as L
    import timm

    import fasttrain

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False, **timm_kwargs)
    if cuda:
        model = model.cuda()  # converted on its device, where the kernels run
    report = fasttrain.convert(model, kernels="fused").summary() if convert else "not converted"

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, batch, _):
            images, labels = batch
            loss = F.cross_entropy(self.model(images), labels)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(1)
    size = model.patch_embed.img_size
    data = torch.utils.data.TensorDataset(
        torch.randn(batch * steps, 3, *size, generator=gen),
        torch.randint(0, model.num_classes, (batch * steps,), generator=gen))
    module = Classifier()
    trainer = L.Trainer(max_steps=steps, accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-mixed" if cuda else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch))
    return module.losses, report


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", [round(x, 4) for x in losses])
