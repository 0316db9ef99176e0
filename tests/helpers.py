"""Workloads for tests that must misbehave."""
import torch

from fasttrain import SimpleWorkload


def broken_workload(size="tiny", seed=0, data=None):
    def boom(model, batch):
        raise RuntimeError("boom")

    return SimpleWorkload(name="broken", build=lambda: torch.nn.Linear(2, 2),
                          data=lambda: [{"x": torch.zeros(2)} for _ in range(8)],
                          loss_fn=boom, default_batch=2)
