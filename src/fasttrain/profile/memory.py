"""Memory: the peak split into parameters, gradients, optimizer state and activations, allocator
slack and churn, growth across steps, the allocator settings in effect, an optional snapshot.

What nvidia-smi shows is the device total (``mem_get_info``: CUDA context, the caching
allocator's reserved segments, other processes), which is why it never matches
``max_memory_allocated``; the split below puts the two side by side.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..measure.files import write_atomic
from ..run.loop import Observer
from ..techniques.base import TrainState

MIB = 1024 ** 2


def tensor_bytes(tensors, device: torch.device | None = None) -> int:
    """Bytes of distinct tensors (on ``device`` only, when given)."""
    seen, total = set(), 0
    for t in tensors:
        if device is not None and torch.is_tensor(t) and t.device.type != device.type:
            continue
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def persistent_split(state: TrainState) -> dict[str, int]:
    """Device bytes held across steps: weights, gradients (one per trainable weight), optimizer
    state (with fp32 master weights and their gradients, when they live on the device), EMA."""
    dev = state.device
    params = list(state.model.parameters()) + list(state.model.buffers())
    trainable = [p for p in state.trainable.parameters() if p.requires_grad]
    opt = [v for st in (state.optimizer.state.values() if state.optimizer else []) for v in st.values()]
    shadow = getattr(state.optimizer, "shadow", [])  # ShadowOptimizer: masters + their grads
    opt += list(shadow) + [s.grad for s in shadow if s.grad is not None]
    ema = state.ema.shadow if state.ema is not None else []
    return {"parameters": tensor_bytes(params, dev), "gradients": tensor_bytes(trainable, dev),
            "optimizer_state": tensor_bytes(opt, dev), "ema": tensor_bytes(ema, dev)}


def growth_per_step(values: list[int]) -> float:
    """Least-squares slope of allocated bytes over steps."""
    n = len(values)
    if n < 3:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    num = sum((i - mx) * (v - my) for i, v in enumerate(values))
    den = sum((i - mx) ** 2 for i in range(n))
    return num / den


class MemoryWatch(Observer):
    """Allocated/reserved after every timed step, allocator counters over the timed window."""

    name = "memory"

    def __init__(self, first_timed: int, snapshot: Path | None = None, max_entries: int = 100_000):
        self.first, self.snapshot, self.max_entries = first_timed, snapshot, max_entries
        self.state: TrainState | None = None
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self.stats0: dict = {}
        self.stats1: dict = {}

    def attach(self, state: TrainState) -> None:
        self.state = state
        if state.cuda and self.snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)

    def begin(self, step: int) -> None:
        if step == self.first and self.state.cuda:
            self.stats0 = torch.cuda.memory_stats(self.state.device)

    def end(self, step: int) -> None:
        if step >= self.first and self.state.cuda:
            self.allocated.append(torch.cuda.memory_allocated(self.state.device))
            self.reserved.append(torch.cuda.memory_reserved(self.state.device))

    def _churn(self) -> dict:
        s0, s1, steps = self.stats0, self.stats1, max(len(self.allocated), 1)
        def delta(key: str) -> int:
            return int(s1.get(key, 0) - s0.get(key, 0))
        mallocs = delta("num_device_alloc") if "num_device_alloc" in s1 else delta(
            "segment.all.allocated")
        span = (max(self.reserved) - min(self.reserved)) if self.reserved else 0
        return {"cuda_malloc_per_step": mallocs / steps,
                "cuda_free_per_step": delta("num_device_free") / steps,
                "alloc_retries": delta("num_alloc_retries"),
                "reserved_pattern": "flat" if span <= 0.01 * max(self.reserved or [1]) else "saw-tooth",
                "reserved_span_mib": span / MIB}

    def report(self) -> dict:
        st = self.state
        split = {k: v / MIB for k, v in persistent_split(st).items()}
        out = {"persistent_mib": split,
               "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
               or os.environ.get("PYTORCH_ALLOC_CONF")}
        if not st.cuda:
            out["note"] = "device memory is measured on CUDA only; the persistent split is exact"
            return out
        torch.cuda.synchronize()
        self.stats1 = torch.cuda.memory_stats(st.device)
        peak = torch.cuda.max_memory_allocated(st.device) / MIB
        reserved = torch.cuda.max_memory_reserved(st.device) / MIB
        free, total = torch.cuda.mem_get_info(st.device)
        out.update(peak_allocated_mib=peak, peak_reserved_mib=reserved,
                   activations_mib=max(peak - sum(split.values()), 0.0),
                   allocator_slack_mib=reserved - peak, device_used_mib=(total - free) / MIB,
                   growth_mib_per_step=growth_per_step(self.allocated) / MIB,
                   expandable_segments="expandable_segments:True" in (out["allocator_conf"] or ""),
                   **self._churn())
        if self.snapshot is not None:
            self.snapshot.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.snapshot, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
            torch.cuda.memory._record_memory_history(enabled=None)
            out["snapshot"] = {"path": str(self.snapshot), "mb": self.snapshot.stat().st_size / 1e6}
        return out
