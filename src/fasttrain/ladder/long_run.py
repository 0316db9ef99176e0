"""The long-run parity mode (``fasttrain ladder --long N``): the switches that change the
numerics, each run for N steps beside the bf16-mixed baseline, their loss curves compared.

A short ladder's parity gate compares losses step by step over a few dozen steps; that shows
a switch computes nearly the same function, not that a model trained with it for days ends
where the baseline does. Here the baseline is the ladder's recipe (``--preset``/``--set``) in
bf16-mixed with every numerics switch off. It runs twice: the repeat measures how far the
baseline strays from itself (on a GPU, nondeterministic kernels make two runs part). Each
variant turns one switch on, alone, and runs the same N steps on the same batches in a fresh
process. The verdict is :func:`fasttrain.measure.curves.compare_curves`'s, its tolerances
widened to the repeat's distance. A variant the workload or device cannot run is a row that
says why.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..errors import FasttrainError
from ..measure.curves import WINDOWS, compare_curves, window_means
from ..measure.env import environment
from ..measure.rows import make_row
from ..recipe import Recipe
from ..run.scratch import scratch
from ..techniques import unmet_requirements
from .spec import LadderSpec, emit, mark_effect, run_rung

BASELINE = "bf16-mixed"
REPEAT = "bf16-mixed (repeat)"
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "fp8": ({"fp8": "linear"}, "fp8 linear layers (e4m3 forward, e5m2 gradients)"),
    "bf16-stream": ({"stream_dtype": "bf16"}, "the residual stream in bf16"),
    "bf16-weights": ({"master_weights": True, "optimizer_impl": "triton"},
                     "bf16 weights, fp32 masters in the optimizer"),
}
"""The switches whose numerics differ from bf16-mixed, each as the changes that turn it on."""
OFF: dict[str, Any] = {"fp8": "none", "stream_dtype": "auto", "master_weights": False}


def long_plan(base: Recipe, names: list[str] | None) -> list[tuple[str, Recipe | None, str]]:
    """(name, recipe or None where it cannot run, what it is / why not): the baseline first,
    then each named variant (all of them by default)."""
    names = names or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise FasttrainError(f"--long: unknown variant {unknown[0]!r}: use {', '.join(VARIANTS)}")
    baseline = base.replace(precision="bf16-mixed", **OFF)
    plan: list[tuple[str, Recipe | None, str]] = [
        (BASELINE, baseline, "the recipe in bf16-mixed, numerics switches off"),
        (REPEAT, baseline, "the baseline again: how far it strays from itself")]
    for name in names:
        changes, what = VARIANTS[name]
        try:
            plan.append((name, baseline.replace(**changes), what))
        except FasttrainError as err:  # e.g. master weights with sharding: refused, said
            plan.append((name, None, f"cannot run: {err}"))
    return plan


Hook = Callable[[dict, int, int], None] | None


def run_long(spec: LadderSpec, names: list[str] | None, on_row: Hook = None) -> list[dict]:
    """Run the baseline and the variants for ``spec.steps`` steps each; rows of kind ``long``
    with the curve verdict against the baseline (appended to ``spec.out`` as they finish)."""
    plan, env, rows = long_plan(spec.base, names), environment(spec.device), []
    ref: dict | None = None
    repeats: list[list[float]] = []
    with scratch("long") as workdir:
        for i, (name, recipe, what) in enumerate(plan):
            row = make_row("long", spec.workload, spec.size, name, what=what, env=env,
                           recipe=recipe.to_dict() if recipe else None)
            unmet = unmet_requirements(recipe, spec.device.split(":")[0]) if recipe else []
            if recipe is None or unmet:
                row.update(skipped=what if recipe is None else "; ".join(unmet), error=None)
            else:
                row.update(run_rung(replace(spec, nproc=1), name, recipe, workdir))
                row.setdefault("error", None)
            if name == BASELINE:
                ref = row
            elif name == REPEAT:
                if _ran(row) and ref is not None and _ran(ref):
                    row["curve"] = repeat_curve(row["losses"], ref["losses"])
                    repeats.append(row["losses"])
            elif _ran(row):
                _judge(row, VARIANTS[name][0], ref, repeats)
            emit(spec, rows, row, on_row, i, len(plan))
    return rows


def repeat_curve(losses: list[float], reference: list[float]) -> dict:
    """The baseline's repeat against the baseline: the noise, shown, never a verdict."""
    return {**compare_curves(losses, reference), "passed": None,
            "reason": "the baseline's repeat: the noise, not a verdict"}


def _judge(row: dict, changes: dict[str, Any], ref: dict | None,
           repeats: list[list[float]]) -> None:
    """A variant that ran: its curve against the baseline's (or why not), its speed-up."""
    if mark_effect(row, changes).get("effect") == "none":
        row["curve"] = {"passed": None, "reason": "not compared: the switch matched nothing "
                        "in this model (no effect)"}
    elif ref is not None and _ran(ref):
        row["curve"] = compare_curves(row["losses"], ref["losses"], repeats=repeats)
        row["speedup"] = ref["step_time_s"] / row["step_time_s"]
    else:
        row["curve"] = {"passed": False, "reason": "the baseline did not run"}


def _ran(row: dict) -> bool:
    return not row.get("error") and not row.get("skipped") and bool(row.get("losses"))


def failures(rows: list[dict]) -> str | None:
    """Why the long run failed (a row that errored, a curve that parted from the baseline's),
    or None."""
    bad = [f"{r['rung']}: {r['error']}" for r in rows if r.get("error")]
    bad += [f"{r['rung']}: {_verdict(r['curve'])}" for r in rows
            if r.get("curve") and r["curve"].get("passed") is False]
    return "; ".join(bad) or None


def _verdict(curve: dict) -> str:
    if curve.get("reason"):
        return curve["reason"]
    tol, noise = curve["tolerance"], curve.get("noise") or {}
    said = (f"the last window's loss is {curve['final_rel_dev']:.2%} from the baseline's "
            f"(allowed {tol['final']:.2%}), the worst window {curve['max_window_rel_dev']:.2%} "
            f"(allowed {tol['window']:.2%})")
    if noise.get("repeats"):
        said += (f"; the baseline's repeat strayed {noise['window']:.2%} at most "
                 f"({noise['final']:.2%} in the last window)")
    return said


def long_table(rows: list[dict]) -> list[str]:
    """The terminal summary: one line per variant."""
    out = [f"{'variant':20s} {'ms/step':>8s} {'speed-up':>8s} {'last loss':>10s} "
           f"{'Δ last':>8s} {'Δ worst':>8s}  verdict"]
    for r in rows:
        if r.get("error") or r.get("skipped"):
            out.append(f"{r['rung']:20s} {'—':>8s} {'—':>8s} {'—':>10s} {'—':>8s} {'—':>8s}  "
                       f"{'error: ' + r['error'] if r.get('error') else 'skipped: ' + r['skipped']}")
            continue
        c, ms = r.get("curve") or {}, r["step_time_s"] * 1e3
        last = c.get("final_loss",
                     window_means(r["losses"], min(WINDOWS, len(r["losses"])))[-1])
        sp = (f"{r['speedup']:.2f}x" if r.get("speedup") else
              "base" if r["rung"] == BASELINE else "—")
        dl = f"{c['final_rel_dev']:.2%}" if "final_rel_dev" in c else "—"
        dw = f"{c['max_window_rel_dev']:.2%}" if "max_window_rel_dev" in c else "—"
        verdict = ("baseline" if not c else "✓" if c.get("passed") else
                   "— " + c["reason"] if c.get("passed") is None else "✗ " + _verdict(c))
        if c.get("passed") and (c.get("noise") or {}).get("repeats"):
            verdict += f" (repeat strayed ≤ {c['noise']['window']:.2%})"
        name = r['rung'] + (f" [{r['slot']}]" if r.get('slot') else "")
        out.append(f"{name:20s} {ms:8.1f} {sp:>8s} {last:10.4f} {dl:>8s} {dw:>8s}  {verdict}")
    return out
