"""How steady a measurement is, and a speed ratio that a disturbed measurement cannot fake.

Two ways a GPU timing goes wrong without an error:

- **Noise inside one run.** Some steps are slow (a host hiccup, a clock dip, another process on
  the device). ``spread(step_times)`` puts the interquartile range of the step times next to
  their median; above ``UNSTEADY_IQR`` the row is marked unsteady.
- **A whole run off.** A disturbance that lasts the whole timed window moves the median with
  every step, so no spread shows it. On an H200 the Swin-B peer once measured 1,217 img/s
  (steps of 44–58 ms) where six runs before and one right after measured 1,729–1,760
  (benchmarks/results/ladder-swin-base-20261121-140645.jsonl): taken at face value, a 2.28×
  ratio instead of 1.6×. Only measuring again shows it.

``confirmed_ratio`` takes the two sides of a comparison measured twice each, in the order
A B B A (ours, peer, peer again, ours again; each in a fresh process), so that a slow drift of
the machine weighs on both sides alike. The ratio it quotes is best against best — each side's
faster measurement, since disturbances only ever slow a run down — and it calls the ratio steady
when each side's two measurements agree within ``REPEAT_TOLERANCE`` and no row is unsteady.
"""
from __future__ import annotations

from statistics import median, quantiles
from typing import Any

__all__ = ["UNSTEADY_IQR", "REPEAT_TOLERANCE", "spread", "confirmed_ratio"]

UNSTEADY_IQR = 0.05
"""Interquartile range of the step times over their median above which a row is unsteady. On
the committed H200 rows at base size the median is 0.7% with CUDA graphs (none above 5% of 98),
0.9% compiled without graphs, 2.2% eager."""

REPEAT_TOLERANCE = 0.03
"""How far two measurements of one recipe in one run may disagree (relative to the faster)
before the ratio is called unsteady: one recipe measured twice in a run differs by 0.1–0.3%
on the H200."""


def spread(step_times: list[float]) -> dict[str, Any] | None:
    """``{"iqr_rel", "range_rel", "steady"}`` of a run's step times (None for fewer than 4
    steps, which say nothing about steadiness)."""
    times = [float(t) for t in step_times or []]
    if len(times) < 4:
        return None
    mid = median(times)
    if mid <= 0:
        return None
    q1, _, q3 = quantiles(times, n=4, method="inclusive")
    iqr = (q3 - q1) / mid
    return {"iqr_rel": iqr, "range_rel": (max(times) - min(times)) / mid,
            "steady": iqr <= UNSTEADY_IQR}


def _usable(row: dict) -> bool:
    return bool(row) and not row.get("error") and not row.get("skipped") \
        and bool(row.get("throughput"))


def _disagreement(rows: list[dict]) -> float:
    t = [r["throughput"] for r in rows]
    return (max(t) - min(t)) / max(t)


def confirmed_ratio(ours: list[dict], peer: list[dict]) -> dict[str, Any] | None:
    """The ratio of two rows measured twice each (A B B A): ``ours`` = [A1, A2] and ``peer`` =
    [B1, B2], rows with ``throughput``. None unless all four ran.

    Returns ``ratio`` (best of ours over best of the peer's), ``ratio_abba`` (the means'
    ratio), the four throughputs, how far each side's repeats disagree, and ``steady`` with the
    ``reason`` when it is not."""
    if len(ours) != 2 or len(peer) != 2 or not all(_usable(r) for r in (*ours, *peer)):
        return None
    a = [r["throughput"] for r in ours]
    b = [r["throughput"] for r in peer]
    dev = {"ours": _disagreement(ours), "peer": _disagreement(peer)}
    names = {"ours": "fasttrain", "peer": "the peer"}
    reasons = [f"{names[side]}'s two measurements differ by {d:.1%} "
               f"({', '.join(f'{x:,.1f}' for x in (a if side == 'ours' else b))})"
               for side, d in dev.items() if d > REPEAT_TOLERANCE]
    for r in (*ours, *peer):
        s = r.get("spread")
        if s and not s.get("steady", True):
            reasons.append(f"{r.get('rung', '?')}: step times spread {s['iqr_rel']:.1%} "
                           f"(interquartile range over median)")
    return {"ratio": max(a) / max(b), "ratio_abba": (sum(a) / 2) / (sum(b) / 2),
            "ours_throughput": a, "peer_throughput": b, "repeat_disagreement": dev,
            "order": "ours, peer, peer, ours", "steady": not reasons,
            "reason": "; ".join(reasons) or None}
