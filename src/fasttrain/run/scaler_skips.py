"""fp16-mixed's skipped steps: which optimizer steps the GradScaler skipped, counted without a
host sync inside the loop.

What: when a step's gradients hold inf/NaN (fp16 overflowed), ``GradScaler.step`` leaves the
weights alone and ``update`` lowers the loss scale; the run goes on. Between the two, the
scaler's per-device found-inf flags say whether this step was skipped: they are summed on the
device into one 0-dim flag a step, and the flags are read once after the run (summed over the
ranks). Numerics: none (only reads). Requirements: a GradScaler that keeps its flags in
``_found_inf_per_device`` (torch 2.x); elsewhere the count is unknown and a warning says so.
"""
from __future__ import annotations

import torch

from ..distributed import env as dist_env


def step_flag(scaler, optimizer, device: torch.device) -> torch.Tensor | None:
    """1.0 on the device where this step's gradients held inf/NaN, else 0.0; None where this
    torch's GradScaler keeps no per-device flags. Call between ``scaler.step`` and
    ``scaler.update`` (which clears them)."""
    per_device = getattr(scaler, "_found_inf_per_device", None)
    found = per_device(optimizer) if per_device else None
    if not found:
        return None
    total = sum(t.to(device, non_blocking=True).float() for t in found.values())
    return total.clamp(max=1.0)


def read(flags: list[torch.Tensor] | None, steps: int) -> tuple[int | None, list[int], str]:
    """``(skipped_steps, scaler_skips, warning)`` from one flag a step (warm-up included):
    the count, the skipped steps (1-based, numbered as the run's losses) and a warning line
    naming them ("" where none was skipped)."""
    if flags is None or len(flags) != steps:
        return None, [], ("precision: the GradScaler's skipped steps could not be counted "
                          "with this torch")
    summed = dist_env.sum_tensor(torch.stack(flags).float()).cpu()
    skips = [i + 1 for i, f in enumerate(summed.tolist()) if f > 0]
    if not skips:
        return 0, [], ""
    shown = ", ".join(map(str, skips[:8])) + (", ..." if len(skips) > 8 else "")
    return len(skips), skips, (
        f"precision: the GradScaler skipped {len(skips)} of {steps} optimizer steps, warm-up "
        f"included (inf/NaN gradients; step {shown}) and lowered its loss scale")
