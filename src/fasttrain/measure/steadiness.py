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
the machine weighs on both sides alike, and a third time where a side is not yet confirmed. A
side is confirmed by two runs with steady steps that agree within ``REPEAT_TOLERANCE``. The
ratio it quotes is best against best — each side's fastest steady run, since disturbances only
ever slow a run down — and it is steady when both sides are confirmed. What no repeat can catch
is a disturbance that slows every run of a side alike and evenly.
"""
from __future__ import annotations

from statistics import median, quantiles
from typing import Any

__all__ = ["UNSTEADY_IQR", "REPEAT_TOLERANCE", "spread", "confirmed_ratio", "needs_another"]

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


# Why a peer's steps scatter where ours do not (H100, timm Swin-B: steps varying by up to 15%
# from one to the next at a fixed SM clock, benchmarks/results/peer-drift-timm_swin-20261127-h100)
PEER_HOST_BOUND = ("the peer launches every kernel from the host (torch.compile without CUDA "
                   "graphs), so its steps follow the host CPU's speed: measure where nothing "
                   "else runs on the machine")


def _usable(row: dict) -> bool:
    return bool(row) and not row.get("error") and not row.get("skipped") \
        and bool(row.get("throughput"))


def _steady(row: dict) -> bool:
    return (row.get("spread") or {}).get("steady", True)


def _side(rows: list[dict], name: str) -> tuple[float, float | None, list[str]]:
    """(best throughput, disagreement of the two fastest steady runs, reasons it is not
    confirmed). A side is confirmed by two runs with steady steps that agree within
    ``REPEAT_TOLERANCE``; its best is then the faster of its steady runs. Unconfirmed, its best
    is its fastest run, whatever its steps."""
    usable = [r for r in rows if _usable(r)]
    steady = [r for r in usable if _steady(r)]
    reasons = [f"{r.get('rung', '?')}: step times spread {r['spread']['iqr_rel']:.1%} "
               f"(interquartile range over median)" for r in usable if not _steady(r)]
    if len(steady) < 2:
        return (max(r["throughput"] for r in usable), None,
                [f"{name} has {len(steady)} of {len(usable)} runs with steady steps, not two "
                 f"to compare", *reasons])
    # the two fastest steady runs: a disturbance slows a run down, it does not make two runs
    # agree on a faster time
    second, first = sorted(r["throughput"] for r in steady)[-2:]
    d = (first - second) / first
    if d > REPEAT_TOLERANCE:
        shown = ", ".join(f"{r['throughput']:,.1f}" for r in steady)
        return (max(r["throughput"] for r in usable), d,
                [f"{name}'s two fastest steady runs differ by {d:.1%} ({shown})", *reasons])
    return first, d, []


def needs_another(rows: list[dict]) -> bool:
    """Whether a side's measurements leave its best unconfirmed (see ``_side``); False when
    fewer than two of them ran at all (a failed run: another would not tell more)."""
    return sum(map(_usable, rows)) >= 2 and bool(_side(rows, "")[2])


def _fastest_step_throughput(row: dict) -> float:
    """The row's throughput at its single fastest step (its median's scaled by the step times),
    or its throughput where it records no fastest step."""
    t, fastest = row.get("step_time_s"), row.get("step_time_min_s")
    return row["throughput"] * t / fastest if t and fastest else row["throughput"]


def confirmed_ratio(ours: list[dict], peer: list[dict]) -> dict[str, Any] | None:
    """The ratio of two sides measured at least twice each (ours, peer, peer, ours, then a
    tie-breaker for a side that needs one): ``ours`` and ``peer`` are rows with
    ``throughput``, in the order they ran. None unless each side has two that ran.

    Returns ``ratio`` (each side's best: the faster of its steady runs once two of them agree
    within ``REPEAT_TOLERANCE``, else its fastest run), ``ratio_mean`` (the means' ratio over
    all runs), the throughputs, how far each side's two fastest steady runs disagree, and
    ``steady`` — both sides confirmed — with the ``reason`` when it is not. ``ratio_floor`` is
    the bound that holds however the sides scatter: our slowest run against the peer at its
    single fastest step of any run (a disturbance only ever slows a step down)."""
    ours = [r for r in ours if _usable(r)]
    peer = [r for r in peer if _usable(r)]
    if len(ours) < 2 or len(peer) < 2:
        return None
    a = [r["throughput"] for r in ours]
    b = [r["throughput"] for r in peer]
    best_a, dev_a, why_a = _side(ours, "fasttrain")
    best_b, dev_b, why_b = _side(peer, "the peer")
    if why_b and not all(map(_steady, peer)):  # unconfirmed, with scattered steps
        why_b.append(PEER_HOST_BOUND)
    reasons = why_a + why_b
    floor = min(a) / max(_fastest_step_throughput(r) for r in peer)
    return {"ratio": best_a / best_b, "ratio_mean": (sum(a) / len(a)) / (sum(b) / len(b)),
            "ratio_floor": floor,
            "ours_throughput": a, "peer_throughput": b,
            "repeat_disagreement": {"ours": dev_a, "peer": dev_b},
            "order": "ours, peer, peer, ours, then a third run of a side not yet confirmed",
            "steady": not reasons, "reason": "; ".join(reasons) or None}
