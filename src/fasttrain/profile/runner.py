"""One profiling run in the real loop, in windows that keep each instrument's cost visible.

Steps after warm-up: ``2n`` steps that alternate plain (phases only) and hooked (per-module
spans), then one profiler warm-up step, then ``active`` steps under torch.profiler (kernel view
and trace). Alternating the two kinds of step lets drift (clocks, caches, a neighbour's load)
fall on both alike: the plain ones give the reference step time and phases, and the hooks'
overhead is the paired hooked−plain difference, next to the difference two plain steps show.
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

PHASE_ORDER = ("data", "forward", "backward", "clip", "optimizer", "ema", "graph")
OTHER = "other (unattributed)"
REST_ROW = 1e-3  # a phase's unattributed rest under this share of the step goes into OTHER


def _window(res, idx: list[int], avg=statistics.median) -> tuple[float, dict[str, float]]:
    """Step time and per-phase time over the timed steps ``idx``. Means add up (for a breakdown
    whose parts sum to the step); medians resist outliers (for the headline step time)."""
    totals = [res.step_times_s[i] for i in idx]
    phases = {k: avg([v[i] for i in idx]) for k, v in res.phase_steps_s.items()
              if len(v) > max(idx)}
    return avg(totals), phases


def breakdown(phases: dict[str, float], modules: dict[str, float], step: float) -> list[dict]:
    """Rows (part, s, share) that add up to ``step``: forward and backward split by submodule
    where measured, a phase's rest as ``<phase> (rest)``, and the loop's own time (observers,
    step boundaries) with rests under ``REST_ROW`` of the step as ``OTHER``. Module parts are
    exclusive spans inside their phase, so they never exceed it (scaled down if they do)."""
    rows = []
    for phase in PHASE_ORDER:
        if phase not in phases:
            continue
        kind = {"forward": "fwd", "backward": "bwd"}.get(phase)
        parts = {k[:-4]: v for k, v in modules.items() if kind and k.endswith(" " + kind)}
        total = sum(parts.values())
        scale = phases[phase] / total if total > phases[phase] > 0 else 1.0
        for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
            rows.append({"part": f"{name} {kind}", "s": sec * scale})
        rest = max(phases[phase] - total * scale, 0.0)
        if not parts or rest >= REST_ROW * step:
            rows.append({"part": f"{phase} (rest)" if parts else phase, "s": rest})
    rows.append({"part": OTHER, "s": max(step - sum(r["s"] for r in rows), 0.0)})
    for row in rows:
        row["share"] = row["s"] / step if step else 0.0
    return rows


def hook_overhead(plain: list[float], hooked: list[float]) -> dict:
    """The hooks' cost from interleaved steps: the median paired difference (hooked − plain) over
    the plain median, clamped at 0. ``noise`` is the same figure between two plain steps; an
    estimate inside it is reported as within noise, and one below −noise as unreliable."""
    base = statistics.median(plain)
    raw = statistics.median(h - p for p, h in zip(plain, hooked)) / base
    noise = (statistics.median(abs(b - a) for a, b in zip(plain, plain[1:])) / base
             if len(plain) > 1 else None)
    within = noise is not None and abs(raw) <= noise
    if noise is None:
        note = f"hook overhead {max(raw, 0):+.1%} (one plain step: noise not measured)"
    elif raw < -noise:
        note = (f"hooked steps ran {-raw:.1%} faster than plain ones, beyond the {noise:.1%} "
                "noise between plain steps: step time is unsteady here (another process, "
                "clock changes); the hook overhead is not measurable on this run")
    else:
        note = (f"hook overhead {max(raw, 0):+.1%} "
                + (f"(within the ±{noise:.1%} noise between plain steps)" if within
                   else f"(noise between plain steps ±{noise:.1%})"))
    return {"overhead": max(raw, 0.0), "raw": raw, "noise": noise, "within_noise": within,
            "note": note}


def _modules_mean(per_step: dict[int, dict[str, float]], steps: list[int]) -> dict[str, float]:
    """Mean seconds per part over ``steps`` (a step where a part did not run counts as 0)."""
    keys = sorted({k for s in steps for k in per_step.get(s, {})})
    return {k: statistics.fmean(per_step.get(s, {}).get(k, 0.0) for s in steps) for k in keys}


def run_profile(workload: Workload, recipe: Recipe, device: str, steps: int = 10,
                warmup: int = 5, active: int = 3, trace_dir: Path | None = None,
                snapshot: Path | None = None) -> dict:
    """Profile ``workload`` under ``recipe``; returns a ``kind: profile`` row with findings."""
    w, n = warmup, steps
    plain_idx, hooked_idx = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))  # timed steps
    mods = ModuleTimer(active={w + i for i in hooked_idx})
    kern = KernelProfiler(start=w + 2 * n + 1, active=active, trace_dir=trace_dir)
    mem = MemoryWatch(first_timed=w, snapshot=snapshot)
    res = train(workload, recipe, steps=2 * n + 1 + active, warmup=w, device=device,
                observers=(mods, kern, mem))
    plain_step, plain_phases = _window(res, plain_idx)
    hooked_step, hooked_phases = _window(res, hooked_idx, avg=statistics.fmean)
    observed = res.observed["modules"]
    module_s = _modules_mean(observed.get("per_step", {}), [w + i for i in hooked_idx])
    over = hook_overhead([res.step_times_s[i] for i in plain_idx],
                         [res.step_times_s[i] for i in hooked_idx]) if module_s else None
    note = observed.get("skipped") or (
        f"breakdown: mean of the {n} hooked steps ({hooked_step * 1e3:,.2f} ms); " + over["note"]
        if over else None)
    profile = make_row("profile", workload.name, workload.size, None, **{
        "recipe": recipe.to_dict(), "device": device.split(":")[0], "batch": res.batch,
        "step_time_s": plain_step, "phases_s": plain_phases,
        "throughput": res.throughput * res.step_time_s / plain_step,
        "throughput_unit": res.throughput_unit,
        "breakdown": breakdown(hooked_phases, module_s, hooked_step),
        "breakdown_step_s": hooked_step, "modules_note": note,
        "profiling_overhead": over["overhead"] if over else None,
        "profiling_overhead_noise": over["noise"] if over else None,
        "profiling_overhead_within_noise": over["within_noise"] if over else None,
        "data_wait_host_s": res.data_wait_host_s, "kernels": res.observed["kernels"],
        "memory": res.observed["memory"], "attention": res.applied.get("attention", ""),
        "compile": res.compile, "warmup_s": res.warmup_s, "model_flops": res.model_flops,
        "mfu": res.mfu, "applied": res.applied, "warnings": res.warnings,
        "compile_scope": getattr(workload, "compile_scope", "model"),
        "losses": res.losses, "error": None, "env": environment(device)})
    profile["findings"] = [f.to_dict() for f in advise(profile, recipe)]
    return profile
