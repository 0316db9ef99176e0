"""One profiling run in the real loop, in windows that keep each instrument's cost visible.

Steps after warm-up: ``n`` plain steps (phases only: the reference), ``n`` steps with per-module
hooks (their overhead = hooked vs plain median), one profiler warm-up step, then ``active``
steps under torch.profiler (kernel view and trace).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from ..measure.env import environment
from ..measure.rows import make_row
from ..recipe import Recipe
from ..run.loop import train
from ..workloads.base import Workload
from .advisor import advise
from .kernels import KernelProfiler
from .memory import MemoryWatch
from .modules import ModuleTimer

PHASE_ORDER = ("data", "forward", "backward", "clip", "optimizer", "ema", "graph", "other")


def _window(res, lo: int, hi: int, avg=statistics.median) -> tuple[float, dict[str, float]]:
    """Step time and per-phase time over timed steps [lo, hi). Means add up (for a breakdown
    whose parts sum to the step); medians resist outliers (for the headline step time)."""
    totals = res.step_times_s[lo:hi]
    phases = {k: avg(v[lo:hi]) for k, v in res.phase_steps_s.items() if v[lo:hi]}
    return avg(totals), phases


def breakdown(phases: dict[str, float], modules: dict[str, float], step: float,
              sole_trainable: str | None = None) -> list[dict]:
    """Rows of (part, ms, share): forward and backward split by submodule where measured."""
    rows = []
    for phase in PHASE_ORDER:
        if phase not in phases:
            continue
        kind = {"forward": "fwd", "backward": "bwd"}.get(phase)
        parts = {k[:-4]: v for k, v in modules.items() if kind and k.endswith(" " + kind)}
        for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
            rows.append({"part": f"{name} {kind}", "s": sec})
        rest = phases[phase] - sum(parts.values())
        label = f"{phase} (rest)" if parts else phase
        if phase == "backward" and not parts and sole_trainable:
            label = f"{sole_trainable} bwd"  # only it has gradients: the backward is its own
        if not parts or rest > 1e-4 * step:
            rows.append({"part": label, "s": max(rest, 0.0)})
    for row in rows:
        row["share"] = row["s"] / step if step else 0.0
    return rows


def run_profile(workload: Workload, recipe: Recipe, device: str, steps: int = 10,
                warmup: int = 5, active: int = 3, trace_dir: Path | None = None,
                snapshot: Path | None = None) -> dict:
    """Profile ``workload`` under ``recipe``; returns a ``kind: profile`` row with findings."""
    w, n = warmup, steps
    mods = ModuleTimer(active=set(range(w + n, w + 2 * n)))
    kern = KernelProfiler(start=w + 2 * n + 1, active=active, trace_dir=trace_dir)
    mem = MemoryWatch(first_timed=w, snapshot=snapshot)
    res = train(workload, recipe, steps=2 * n + 1 + active, warmup=w, device=device,
                observers=(mods, kern, mem))
    plain_step, plain_phases = _window(res, 0, n)
    hooked_step, hooked_phases = _window(res, n, 2 * n, avg=statistics.fmean)
    module_s = res.observed["modules"].get("module_s", {})
    profile = make_row("profile", workload.name, workload.size, None, **{
        "recipe": recipe.to_dict(), "device": device.split(":")[0], "batch": res.batch,
        "step_time_s": plain_step, "phases_s": plain_phases,
        "throughput": res.throughput * res.step_time_s / plain_step,
        "throughput_unit": res.throughput_unit,
        "breakdown": breakdown(hooked_phases, module_s, hooked_step,
                               res.observed["modules"].get("sole_trainable")),
        "modules_note": res.observed["modules"].get("skipped"),
        "profiling_overhead": (_window(res, n, 2 * n)[0] / plain_step - 1.0) if module_s else None,
        "data_wait_host_s": res.data_wait_host_s, "kernels": res.observed["kernels"],
        "memory": res.observed["memory"], "attention": res.applied.get("attention", ""),
        "compile": res.compile, "warmup_s": res.warmup_s, "model_flops": res.model_flops,
        "mfu": res.mfu, "applied": res.applied, "warnings": res.warnings,
        "compile_scope": getattr(workload, "compile_scope", "model"),
        "losses": res.losses, "error": None, "env": environment(device)})
    profile["findings"] = [f.to_dict() for f in advise(profile, recipe)]
    return profile
