"""A small convolutional network in plain PyTorch (a ResNet-style stack of 3x3 convolutions,
BatchNorm and ReLU) as a fasttrain workload, on CIFAR-10-sized images (32 pixels, 10 classes,
batch 512).

    fasttrain ladder examples.cnn:make_workload                      # tiny, on any machine
    fasttrain ladder examples.cnn:make_workload --size base --peer   # on a GPU

Small convolutions are launch-bound on a large GPU: channels-last layouts and the whole step as
one CUDA graph are what make them fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain import SimpleWorkload

SIZES = {"tiny": dict(image=16, widths=(8, 16), classes=10, batch=8),
         "base": dict(image=32, widths=(64, 128, 256), classes=10, batch=512)}


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(width, width), conv_bn(width, width))

    def forward(self, x):
        return x + self.body(x)


class SmallCNN(nn.Module):
    def __init__(self, widths=(64, 128, 256), classes: int = 100):
        super().__init__()
        layers, cin = [], 3
        for i, w in enumerate(widths):
            layers += [conv_bn(cin, w, stride=1 if i == 0 else 2), Residual(w)]
            cin = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class RandomImages(torch.utils.data.Dataset):
    def __init__(self, image: int, classes: int, n: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, image, image, generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"images": self.images[i], "labels": self.labels[i]}


def make_workload(size: str = "tiny", seed: int = 0, data=None) -> SimpleWorkload:
    if size not in SIZES:
        raise ValueError(f"size {size!r}: use tiny or base")
    cfg = SIZES[size]
    return SimpleWorkload(
        name=f"cnn-{size}", size=size,
        build=lambda: SmallCNN(cfg["widths"], cfg["classes"]),
        data=lambda: RandomImages(cfg["image"], cfg["classes"], seed=seed),
        loss_fn=lambda model, b: F.cross_entropy(model(b["images"]), b["labels"], reduction="sum"),
        unit="img", default_batch=cfg["batch"],
    )
