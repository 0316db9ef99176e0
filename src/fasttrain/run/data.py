"""An endless, seeded stream of batches through a real DataLoader.

The sampler yields ``epoch * n + index``; the wrapper hands the epoch to the dataset inside the
worker that loads the item, so per-epoch augmentation stays deterministic with any number of
persistent workers.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..workloads.base import Batch, Workload


class EpochIndexed(Dataset):
    def __init__(self, base: Dataset):
        self.base, self.n = base, len(base)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        epoch, index = divmod(i, self.n)
        if hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)
        return self.base[index]


class EndlessSampler(Sampler[int]):
    """A fresh seeded permutation each epoch, forever."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __iter__(self) -> Iterator[int]:
        epoch = 0
        while True:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            for i in torch.randperm(self.n, generator=g).tolist():
                yield epoch * self.n + i
            epoch += 1


def make_loader(workload: Workload, micro_batch: int, seed: int, dataset: Dataset | None = None,
                **loader_kwargs) -> DataLoader:
    ds = workload.dataset() if dataset is None else dataset
    if len(ds) < micro_batch:
        raise ValueError(f"data set has {len(ds)} items, fewer than one batch of {micro_batch}")
    return DataLoader(EpochIndexed(ds), batch_size=micro_batch, sampler=EndlessSampler(len(ds), seed),
                      drop_last=True, collate_fn=workload.collate, **loader_kwargs)


def to_device(batch: Batch, device: torch.device, non_blocking: bool) -> Batch:
    return {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v
            for k, v in batch.items()}
