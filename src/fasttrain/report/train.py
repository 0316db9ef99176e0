"""Terminal summary of one ``fasttrain train`` row: what ran, how fast, how much memory, how the
loss moved, what the techniques did and what they warned about (rendered from the row only)."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .table import on_cpu


def _switches(recipe: dict, default: dict) -> str:
    """The recipe's switches that differ from ``default``, ``key=value``."""
    changed = [f"{k}={v}" for k, v in recipe.items() if default.get(k, v) != v]
    return ", ".join(changed) or "every switch at its default"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def _step(row: dict) -> str:
    spread = row.get("spread") or {}
    steady = "" if spread.get("steady", True) else " ⚠ unsteady"
    iqr = f", spread {spread['iqr_rel']:.1%}{steady}" if "iqr_rel" in spread else ""
    return (f"{_ms(row.get('step_time_s'))} median ({_ms(row.get('step_time_min_s'))} – "
            f"{_ms(row.get('step_time_max_s'))}{iqr})")


def _memory(row: dict) -> str:
    alloc, reserved = row.get("peak_allocated_gib"), row.get("peak_reserved_gib")
    if alloc is None:
        return "not measured on this device (CUDA only)"
    return f"{alloc:.2f} GiB allocated, {reserved or 0:.2f} GiB reserved"


def _loss(row: dict) -> str:
    losses = row.get("losses") or []
    if not losses:
        return "–"
    skipped = row.get("skipped_steps")
    note = f"; the GradScaler skipped {skipped}" if skipped else ""
    return (f"{_num(losses[0])} → {_num(losses[-1])} over {len(losses)} steps (warm-up "
            f"included{note})")


def _checkpoint(ck: dict) -> str:
    """Where the run started from and what it left: 'resumed from A at step N; saved B'."""
    parts = []
    if ck.get("resumed_from"):
        parts.append(f"resumed from {ck['resumed_from']}")
    if ck.get("saved"):
        parts.append(f"saved {ck['saved']}" + (f" (the newest of {ck['kept']} kept)"
                                                if (ck.get("kept") or 0) > 1 else ""))
    if ck.get("exported"):
        parts.append(f"exported {ck['exported']}")
    return "; ".join(parts) or "–"


def _num(x: float | None) -> str:
    return "NaN/inf" if x is None else f"{x:.4g}"


def train_summary(row: dict, path: str | None = None, defaults: dict | None = None) -> Group:
    """The summary of a train row; ``path`` is where the full row was written, ``defaults``
    the default recipe (as a dict), to name the switches this run changed."""
    env = row.get("env") or {}
    head = Text.assemble(("fasttrain train", "bold"), f" · {row.get('workload')} "
                         f"{row.get('size')} · {env.get('device_name') or '?'}")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("recipe", Text(f"{row.get('recipe_name') or 'default'}: "
                                f"{_switches(row.get('recipe') or {}, defaults or {})}"))
    steps = row.get("steps") or 0
    warm = max(len(row.get("losses") or []) - steps, 0)
    grid.add_row("batch", f"{row.get('batch')} · {steps} timed steps after {warm} warm-up "
                 f"step{'s' if warm != 1 else ''} ({row.get('warmup_s') or 0:.1f} s)")
    grid.add_row("step", _step(row))
    rate = row.get("throughput") or 0
    grid.add_row("throughput", f"{rate:,.1f} {row.get('throughput_unit', '')}")
    if row.get("tflops"):
        mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") else ""
        tflops = format(row["tflops"], ",.1f" if row["tflops"] >= 1 else ".2g")
        grid.add_row("compute", f"{tflops} TFLOP/s{mfu}")
    grid.add_row("peak memory", _memory(row))
    grid.add_row("loss", _loss(row))
    if row.get("checkpoint"):
        grid.add_row("checkpoint", _checkpoint(row["checkpoint"]))
    if row.get("applied") or row.get("no_effect"):
        grid.add_row("techniques", "what each did:")
    for name, what in (row.get("applied") or {}).items():
        grid.add_row(f"  {name}", Text(str(what)))
    for name, why in (row.get("no_effect") or {}).items():
        grid.add_row(f"  {name}", Text(f"no effect: {why}"))
    parts = [head, grid]
    for i, warning in enumerate(row.get("warnings") or [], 1):
        parts.append(Text(f"⚠ {i}. {warning}", style="yellow"))
    if on_cpu(row):
        parts.append(Text("CPU timings check the plumbing, not speed-ups worth quoting.",
                          style="dim"))
    if path:
        parts.append(Text(f"row: {path}"))
    return Group(*parts)
