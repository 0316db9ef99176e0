"""Lightning with ``fasttrain.Step``: manual optimization, the step made fast inside
``training_step`` (a plain ViT from examples/vit.py). The Step steps the optimizer Lightning
built; a learning-rate scheduler is then yours to step, as always under manual optimization.

    python -m examples.step_lightning
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.vit import SIZES, ViT


def loss_fn(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def main(steps: int = 3, use_step: bool = True, batch: int = 4) -> tuple[list[float], str]:
    """Train ``steps`` steps with ``lightning.Trainer``; returns the losses and the step's
    report."""
    import lightning as L

    import fasttrain

    cuda = torch.cuda.is_available()
    cfg = SIZES["tiny"]
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(batch * steps, 3, cfg.image, cfg.image, generator=gen),
        torch.randint(0, cfg.classes, (batch * steps,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, drop_last=True)

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model, self.losses, self.step = ViT(cfg), [], None
            self.automatic_optimization = not use_step  # the Step steps the optimizer

        def on_train_start(self):
            if use_step:  # on the device Lightning chose, with the optimizer it built
                first = [t.to(self.device) for t in next(iter(loader))]
                self.step = fasttrain.Step(self.model, self.optimizers().optimizer, loss_fn,
                                           first, recipe={"compile": "none"})

        def training_step(self, batch, _):
            if use_step:
                loss = self.step(batch)
            else:
                loss = loss_fn(self.model, batch)
            self.losses.append(float(loss))
            return None if use_step else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Classifier()
    # max_epochs, not max_steps: under manual optimization Lightning counts a step when its own
    # optimizer wrapper steps, and the Step steps the optimizer itself
    trainer = L.Trainer(max_epochs=1, limit_train_batches=steps, accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=None if use_step else 1.0)
    trainer.fit(module, loader)
    return module.losses, repr(module.step) if use_step else "plain"


if __name__ == "__main__":
    losses, report = main()
    print(report)
    print("losses:", [round(x, 4) for x in losses])
