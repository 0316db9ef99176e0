"""Result rows as TensorBoard scalars: one run folder per row, per-step curves.

A row already holds every step's loss, the timed steps' times and the learning rate of every
step, so the curves are written from it when the run ends (the loop reads nothing back from the
device while it runs). Per step: ``loss``, ``lr``, ``step_time_ms`` and ``throughput`` (the
step's items over its time; steps are counted from the first, warm-up included, so the timed
steps start at ``warmup``); once per run: ``peak_allocated_gib``, ``tflops``.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import FasttrainError


def _writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise FasttrainError("--tensorboard needs the tensorboard package: pip install "
                             "tensorboard") from None
    return SummaryWriter(log_dir=str(folder))


def run_name(row: dict) -> str:
    """A folder name for the row: its rung (or peer), made file-safe."""
    name = row.get("rung") or row.get("kind") or "run"
    if row.get("kind") == "peer":
        name = f"peer-{row.get('peer') or name}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(name)).strip("_") or "run"


def write_scalars(rows: list[dict], folder: str | Path) -> list[Path]:
    """One TensorBoard run per measured row under ``folder``; the run folders written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FasttrainError(f"--tensorboard {folder} is a file: give a folder")
    written = []
    for row in rows:
        if row.get("error") or row.get("skipped") or not row.get("losses"):
            continue
        path = folder / run_name(row)
        w = _writer(path)
        try:
            _write_row(w, row)
        finally:
            w.close()
        written.append(path)
    return written


def _write_row(w, row: dict) -> None:
    losses, times = row["losses"], row.get("step_times_s") or []
    warm = len(losses) - len(times)  # the timed steps are the last ones
    for i, loss in enumerate(losses):
        w.add_scalar("loss", loss, i + 1)
    for i, lr in enumerate(row.get("lrs") or []):
        w.add_scalar("lr", lr, i + 1)
    # items a step: throughput is the mean items of a step over the median step time
    items = (row.get("throughput") or 0) * (row.get("step_time_s") or 0)
    for i, t in enumerate(times):
        w.add_scalar("step_time_ms", t * 1e3, warm + i + 1)
        if items and t:
            w.add_scalar(f"throughput ({row.get('throughput_unit') or 'items/s'})", items / t,
                         warm + i + 1)
    last = len(losses)
    for key in ("peak_allocated_gib", "tflops"):
        if row.get(key) is not None:
            w.add_scalar(key, row[key], last)
