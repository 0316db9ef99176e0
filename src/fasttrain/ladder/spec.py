"""What a ladder runs, and how one rung is run and checked: the pieces that the ladder, the
confirmation against the peer and the scaling report share."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..measure.parity import compare_rows, unrecovered
from ..measure.rows import append_row
from ..recipe import Recipe
from ..run.child import ChildSpec, run_in_child
from ..techniques import allocator, technique_of


@dataclass
class LadderSpec:
    """What to run: the workload, which rungs, how long, where the rows go."""

    workload: str = "vit"
    size: str = "tiny"
    rungs: list[str] | None = None
    base: Recipe = field(default_factory=Recipe)
    steps: int = 20
    warmup: int = 5
    device: str = "cpu"
    data: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    peer: bool = False
    rung_timeout: float | None = None
    extra_rungs: list[tuple[str, Recipe]] = field(default_factory=list)
    nproc: int = 1  # processes per rung, launched through torchrun
    start_at: str | None = None  # run the first rung (the parity base), then from this rung on
    confirm: bool = True  # with the peer: measure both sides again (A B B A), confirm.py


def run_rung(spec: LadderSpec, name: str, recipe: Recipe, workdir: Path) -> dict:
    """One measured run of ``recipe`` in a fresh process (``nproc`` under torchrun); its row."""
    child = ChildSpec(job="fasttrain.run.child:train_job", workload=spec.workload,
                      size=spec.size, device=spec.device, recipe=recipe.to_dict(),
                      steps=spec.steps, warmup=spec.warmup, data=spec.data, options=spec.options)
    return run_in_child(child, workdir, name, spec.rung_timeout, allocator.child_env(recipe),
                        nproc=spec.nproc)


def finish_row(row: dict, ref: dict | None, precision: str) -> dict:
    """Parity against the reference rung; TFLOP/s from the reference's FLOP count."""
    if row.get("error") or row.get("skipped") or not ref or ref.get("error"):
        return row
    row["parity"] = compare_rows(row, ref, precision)
    if ref.get("model_flops"):
        flops = ref["model_flops"] * row["batch"] / ref["batch"]
        row["probe_flops"], row["model_flops"] = row.get("model_flops"), flops
        row["tflops"] = flops / row["step_time_s"] / 1e12
        if row.get("mfu") is not None and row.get("probe_flops"):
            row["mfu"] = row["mfu"] * flops / row["probe_flops"]
    row["speedup"] = speedup(row, ref)
    return row


def mark_effect(row: dict, changes: dict[str, Any]) -> dict:
    """A rung whose own changes all map to techniques that matched nothing in its run (the row's
    ``no_effect``: a flash-attention rung on a CNN) is marked ``effect: none`` with their reasons
    and loses its speed-up: its time differs from the rung before it only by noise. The rungs
    after it keep theirs, still measured against the base."""
    idle = row.get("no_effect") or {}
    techs = {technique_of(f) for f in changes}
    if row.get("error") or row.get("skipped") or not techs or not techs <= idle.keys():
        return row
    row["effect"] = "none"
    row["effect_reasons"] = {t: idle[t] for t in sorted(techs)}
    row["speedup"] = None
    return row


def speedup(row: dict, ref: dict) -> float | None:
    """Items a second of ``row`` over the reference's (step times scaled by the batches); None
    for a run whose loss went NaN/inf and did not recover (skipped optimizer steps are not a
    speed-up)."""
    if unrecovered(row.get("losses") or [], row.get("scaler_skips")) is not None:
        return None
    return ref["step_time_s"] / row["step_time_s"] * row["batch"] / ref["batch"]


def emit(spec: LadderSpec, rows: list[dict], row: dict, on_row, i: int, total: int) -> None:
    """Keep ``row``, append it to ``spec.out`` and hand it to ``on_row``."""
    rows.append(row)
    if spec.out:
        append_row(spec.out, row)
    if on_row:
        on_row(row, i, total)
