"""A user's own model as a fasttrain workload: a plain nn.Module and a Dataset.

    fasttrain ladder examples.my_workload:make_workload     (with examples/ importable)
"""
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain import SimpleWorkload


class TinyClassifier(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(x)


class _Dict(torch.utils.data.Dataset):
    """fasttrain batches are dicts of tensors."""

    def __init__(self, n: int = 512, dim: int = 32, classes: int = 4):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x[:, :classes].argmax(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def make_workload(size: str = "tiny", seed: int = 0, data=None, **options) -> SimpleWorkload:
    return SimpleWorkload(
        name="my-classifier",
        build=TinyClassifier,
        data=_Dict,
        # summed over the batch: fasttrain divides by the step's sample count
        loss_fn=lambda model, b: F.cross_entropy(model(b["x"]), b["y"], reduction="sum"),
        unit="sample",
        default_batch=32,
    )
