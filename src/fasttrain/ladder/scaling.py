"""Scaling report: per-GPU throughput and memory at 1/2/4/8 processes for each sharding mode.

Each (world size, sharding) point is one rung in fresh processes under torchrun with the same
per-GPU batch; efficiency = per-GPU throughput / the best single-process throughput at that
per-GPU batch (DESIGN.md's ``scaling`` row), so sharding overhead counts against it. At one
world size every mode sees the same global batches, so each mode's losses are checked against the
first mode's with the precision-aware parity tolerance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..measure.env import environment
from ..recipe import Recipe
from ..measure.parity import compare_rows
from ..measure.rows import append_row, make_row
from ..run.scratch import scratch
from .spec import LadderSpec, run_rung


def run_scaling(workload: str, size: str, recipe: Recipe, worlds: list[int], modes: list[str],
                per_gpu_batch: int, device: str, steps: int = 20, warmup: int = 5,
                out: Path | None = None, on_row: Callable[[dict], None] | None = None,
                timeout: float | None = None) -> list[dict]:
    env, rows, best_single = environment(device), [], None
    with scratch("scaling") as tmp:
        for world in sorted(worlds):
            ref = None  # the world's first mode that ran: the others must match its losses
            for mode in (["none"] if world == 1 else modes):
                rec = recipe.replace(sharding=mode, batch=per_gpu_batch * world)
                spec = LadderSpec(workload=workload, size=size, steps=steps, warmup=warmup,
                                  device=device, nproc=world, rung_timeout=timeout)
                name = f"w{world}-{mode}"
                row = make_row("scaling", workload, size, name,
                               **{**run_rung(spec, name, rec, tmp), "world_size": world,
                                  "sharding": mode, "recipe": rec.to_dict(),
                                  "per_gpu_batch": per_gpu_batch, "env": env})
                if not row.get("error"):
                    row["total_throughput"] = row["throughput"]
                    row["throughput"] = row["throughput"] / world  # per GPU
                    if world == 1:
                        best_single = max(best_single or 0.0, row["throughput"])
                    row["efficiency"] = (row["throughput"] / best_single) if best_single else None
                    if ref is None:
                        ref = row
                    else:  # the sharding modes at one world size must train the same model
                        row["parity"] = {**compare_rows(row, ref, rec.precision),
                                         "against": ref["rung"]}
                rows.append(row)
                if out:
                    append_row(out, row)
                if on_row:
                    on_row(row)
    return rows
