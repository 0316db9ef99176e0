"""Long-run parity: does a switch that changes the numerics train like the baseline over
thousands of steps?

Step by step, two runs that round differently part ways within a few hundred steps (training
is chaotic: a last-bit difference grows), so the per-step gate of a short ladder says nothing
over a long run. What must agree is the curve: the mean loss over windows of the run. The run
is cut into :data:`WINDOWS` equal windows; a switch passes when the mean loss of the last window
is within :data:`FINAL_TOLERANCE` of the baseline's, and no window after the first (the first
holds the steep start, where a shift of one step is a large relative change) deviates by more
than :data:`WINDOW_TOLERANCE`. A deviation is relative to the baseline's window, but never to
less than :data:`LOSS_FLOOR` of the baseline's first window: a model that learns its data by heart
drives the loss towards 0, where 0.0008 against 0.0005 is a large ratio of two losses that both
say "learned".

Those fixed tolerances are a floor. The baseline run again with the same seed and recipe does
not repeat itself on a GPU (atomics in the backward pass, kernel choices), and while the loss
still falls steeply the repeats' curves part by more than the floor: a 1B-parameter Llama at one
sequence a step ended 2,000 steps 9% apart from its own repeat. Where the baseline was repeated,
the noise is the farthest a repeat strayed from the baseline in any window after the first, and
each tolerance is the larger of its floor and :data:`NOISE_FACTOR` times the noise: a switch
passes when its curve stays about as close to the baseline as the baseline's own repeat. Not
closer than once the noise: an unchanged switch is as likely as the repeat to be the farther
one, and would fail half the time. Twice the largest of 19 windows: were the windows' noise
independent and Gaussian, an unchanged switch would fail about 1 run in 100 (simulated).
"""
from __future__ import annotations

import math

WINDOWS = 20
FINAL_TOLERANCE = 0.02
WINDOW_TOLERANCE = 0.05
LOSS_FLOOR = 0.01
NOISE_FACTOR = 2.0


def window_means(losses: list[float], windows: int = WINDOWS) -> list[float]:
    """The mean loss of each of ``windows`` equal consecutive windows (the last one takes the
    remainder)."""
    if len(losses) < windows:
        raise ValueError(f"{len(losses)} losses cannot fill {windows} windows")
    size = len(losses) // windows
    cuts = [i * size for i in range(windows)] + [len(losses)]
    return [sum(losses[a:b]) / (b - a) for a, b in zip(cuts, cuts[1:])]


def compare_curves(losses: list[float], reference: list[float], windows: int = WINDOWS,
                   repeats: list[list[float]] | None = None) -> dict:
    """The verdict on ``losses`` against the baseline's ``reference`` over the same steps:
    ``{passed, final_rel_dev, max_window_rel_dev, final_loss, reference_final_loss,
    reference_drop, window_steps, tolerance, noise}``, or ``{passed: False, reason}``.

    ``repeats``: other runs of the baseline (same recipe and seed); how far they strayed from
    ``reference`` (``noise``) widens the tolerances. ``reference_drop`` is how much the baseline
    learned (1 − last window / first window): a curve that agrees with a baseline that learned
    nothing proves little, and says so."""
    noise = _noise(reference, repeats or [], windows)
    tol = {"final": max(FINAL_TOLERANCE, NOISE_FACTOR * noise["window"]),
           "window": max(WINDOW_TOLERANCE, NOISE_FACTOR * noise["window"])}
    if len(losses) != len(reference):
        return {"passed": False, "tolerance": tol,
                "reason": f"{len(losses)} losses against {len(reference)} baseline losses"}
    if len(losses) < 2 * windows:
        return {"passed": False, "tolerance": tol,
                "reason": f"{len(losses)} steps are too few for a curve (at least {2 * windows})"}
    for name, xs in (("", losses), ("baseline ", reference)):
        bad = next((i + 1 for i, x in enumerate(xs) if x is None or not math.isfinite(x)), None)
        if bad is not None:
            return {"passed": False, "tolerance": tol, "reason": f"{name}NaN/inf loss at step {bad}"}
    mine, ref = window_means(losses, windows), window_means(reference, windows)
    final, worst = _deviations(mine, ref)
    return {"passed": final <= tol["final"] and worst <= tol["window"],
            "final_rel_dev": final, "max_window_rel_dev": worst,
            "final_loss": mine[-1], "reference_final_loss": ref[-1],
            "reference_drop": 1.0 - ref[-1] / ref[0] if ref[0] else None,
            "window_steps": len(losses) // windows, "tolerance": tol, "noise": noise}


def _deviations(mine: list[float], ref: list[float]) -> tuple[float, float]:
    """(the last window's relative deviation, the largest after the first window); relative to
    the baseline's window, or to LOSS_FLOOR of its first window where that is larger."""
    floor = max(LOSS_FLOOR * abs(ref[0]), 1e-12)
    devs = [abs(a - b) / max(abs(b), floor) for a, b in zip(mine, ref)]
    return devs[-1], max(devs[1:])


def _noise(reference: list[float], repeats: list[list[float]], windows: int) -> dict:
    """The farthest the baseline's finite repeats of the same length strayed from it:
    ``{final, window, repeats}`` (0 without repeats)."""
    usable = [r for r in repeats if len(r) == len(reference) >= 2 * windows
              and all(x is not None and math.isfinite(x) for x in r)]
    if not usable or not all(x is not None and math.isfinite(x) for x in reference):
        return {"final": 0.0, "window": 0.0, "repeats": 0}
    ref = window_means(reference, windows)
    devs = [_deviations(window_means(r, windows), ref) for r in usable]
    return {"final": max(d[0] for d in devs), "window": max(d[1] for d in devs),
            "repeats": len(usable)}
