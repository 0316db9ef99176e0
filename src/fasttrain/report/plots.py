"""The HTML report's charts, drawn with matplotlib from result rows only.

One function per chart: rows in, a matplotlib ``Figure`` out, or ``None`` where the rows carry
nothing that chart draws. Figures get their own Agg canvas (no pyplot, no ``matplotlib.use``),
so importing this module or drawing a chart changes no global state; matplotlib itself is
imported only when a chart is drawn.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .table import on_cpu

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BLUE, RED, ORANGE, GREY, GREEN = "#4C72B0", "#C44E52", "#DD8452", "#8C8C8C", "#55A868"
REFERENCE = "fp32"  # the ladder rung every other rung's losses are compared with


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1, **grid):
    """A figure with its own Agg canvas and its axes (``nrows`` x ``ncols``) in a flat list."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(nrows, ncols, squeeze=False, gridspec_kw=grid or None).flat)


def _first(rows: list[dict]) -> list[dict]:
    """Rows without the repeats of a rung (the table lists those)."""
    return [r for r in rows if not r.get("repeat_of")]


def _measured(row: dict) -> bool:
    return not row.get("error") and not row.get("skipped") and row.get("throughput") is not None


def _labels(rows: list[dict], width: int = 20) -> list[str]:
    """Each row's name (its rung; a profile row's workload), prefixed with the workload where
    the rows hold several, wrapped, and made unique."""
    tagged = len({(r.get("workload"), r.get("size")) for r in rows}) > 1
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        name = r.get("rung") or f"{r.get('workload')} {r.get('size')}"
        if tagged and r.get("rung"):
            name = f"{r.get('workload')} {r.get('size')}: {name}"
        seen[name] = seen.get(name, 0) + 1
        name += f" #{seen[name]}" if seen[name] > 1 else ""
        out.append(textwrap.fill(name, width))
    return out


def _mark(passed) -> str:
    return "" if passed is None else ("✓" if passed else "✗")


def _bars(ax, rows: list[dict], values: list[float | None], notes: list[str], unit: str,
          floor: float = 0.0) -> float:
    """Bars of ``values`` (one a row) from ``floor`` up, with ``notes`` on top; an error or
    skipped row is a labelled, hatched stub; a failed row (parity or accuracy) is red.
    Returns the tallest value."""
    x = list(range(len(rows)))
    top = max([v for v in values if v is not None], default=0.0) or 1.0
    stub = (top - floor) * 0.06
    colors = [RED if (r.get("parity") or r.get("accuracy") or {}).get("passed") is False else BLUE
              for r in rows]
    ax.bar(x, [(v - floor) if v is not None else 0.0 for v in values], bottom=floor,
           color=colors, width=0.7)
    for i, (r, v, note) in enumerate(zip(rows, values, notes)):
        if r.get("error") or r.get("skipped") or v is None:
            what = "error" if r.get("error") else ("skipped" if r.get("skipped") else "n/a")
            color = RED if r.get("error") else GREY
            ax.bar(i, stub, bottom=floor, color="none", edgecolor=color, hatch="//", width=0.7)
            ax.text(i, floor + stub * 1.3, what, rotation=90, ha="center", va="bottom",
                    fontsize=8, color=color)
        elif note:
            ax.text(i, v, note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, _labels(rows), rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_ylim(floor, floor + (top - floor) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    return top


def _peer_lines(ax, peers: list[dict], value: Callable[[dict], float | None], fmt: str):
    colors = (ORANGE, GREEN, GREY, "#8172B3")
    for i, p in enumerate(peers):
        v = value(p)
        if v is not None:
            ax.axhline(v, ls="--", lw=1.4, color=colors[i % len(colors)],
                       label=f"peer: {p.get('peer') or p.get('rung')} ({format(v, fmt)})")
    if any(value(p) is not None for p in peers):
        ax.legend(fontsize=8, loc="upper left")


def _by_workload(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (workload, size), in the order they first appear."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("workload"), r.get("size")), []).append(r)
    return groups


def ladder_chart(rows: list[dict]) -> Figure | None:
    """Throughput per ladder rung, parity (✓/✗) and speed-up on each bar (not for CPU timings),
    the peer as a line; one panel per workload, each in its own unit."""
    groups = _by_workload(_first([r for r in rows if r.get("kind") == "ladder"]))
    if not groups:
        return None
    peers = _first([r for r in rows if r.get("kind") == "peer" and _measured(r)])
    widest = max(len(g) for g in groups.values())
    fig, axes = _figure(max(7.0, 0.8 * widest + 3), 4.8 * len(groups), nrows=len(groups))
    for ax, ((workload, size), ladder) in zip(axes, groups.items()):
        mine = [p for p in peers if (p.get("workload"), p.get("size")) == (workload, size)]
        notes = [f"{_mark((r.get('parity') or {}).get('passed'))}"
                 + (f" {r['speedup']:.2f}×" if r.get("speedup") and not on_cpu(r) else "")
                 for r in ladder]
        values = [r.get("throughput") if _measured(r) else None for r in ladder]
        top = _bars(ax, ladder, values, notes,
                    f"throughput ({ladder[0].get('throughput_unit', '')})")
        ax.set_ylim(0, max([top] + [p["throughput"] for p in mine]) * 1.18)
        _peer_lines(ax, mine, lambda p: p.get("throughput"), ",.0f")
        where = f"{workload} {size}: " if len(groups) > 1 else ""
        ax.set_title(f"{where}throughput per rung (✓/✗: loss parity with fp32; ×: speed-up)",
                     fontsize=10)
    return fig


def loss_chart(rows: list[dict]) -> Figure | None:
    """Every rung's losses step by step, the fp32 rung drawn thick; beside them each rung's
    relative deviation from fp32 with the parity tolerances."""
    ladder = _first([r for r in rows if r.get("kind") == "ladder" and r.get("losses")])
    if not ladder:
        return None
    refs = {(r.get("workload"), r.get("size")): r["losses"] for r in ladder
            if r.get("rung") == REFERENCE}
    fig, axes = _figure(12.0, 4.5, ncols=2 if refs else 1)
    for r, name in zip(ladder, _labels(ladder, width=40)):
        name = name.replace("\n", " ")
        base = r.get("rung") == REFERENCE
        steps = range(1, len(r["losses"]) + 1)
        axes[0].plot(steps, r["losses"], label=name, lw=3.5 if base else 1.1,  # fp32 beneath
                     color="black" if base else None, alpha=0.35 if base else 1.0,
                     zorder=1 if base else 2)
        ref = refs.get((r.get("workload"), r.get("size")))
        if ref is None or base:
            continue
        dev = [max(abs(a - b) / (abs(b) or 1.0), 1e-8) for a, b in zip(r["losses"], ref)]
        axes[1].semilogy(range(1, len(dev) + 1), dev, label=name, lw=1.1)
    axes[0].set(xlabel="step", ylabel="loss", title="losses (fp32 thick, grey)")
    axes[0].legend(fontsize=7, ncol=2)
    if refs:
        for tol in sorted({(r.get("parity") or {}).get("tolerance") for r in ladder} - {None}):
            axes[1].axhline(tol, ls=":", color=GREY)
            axes[1].text(1, tol, f"tolerance {tol:g}", fontsize=7, va="bottom", color=GREY)
        axes[1].set(xlabel="step", ylabel="|loss − fp32| / fp32",
                    title="deviation from fp32 (0 drawn at 1e-8)")
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def _breakdown_ms(row: dict) -> dict[str, float] | None:
    """A row's step split in ms: a profile row's ``breakdown`` (phases, or top-level modules'
    forward/backward), a ladder rung's timed ``phases_s``."""
    if row.get("kind") == "profile" and row.get("breakdown"):
        return {b["part"]: b["s"] * 1e3 for b in row["breakdown"]}
    if row.get("kind") == "ladder" and row.get("phases_s") and _measured(row):
        return {k: v * 1e3 for k, v in row["phases_s"].items()}
    return None


def _stacked(ax, names: list[str], parts: list[dict[str, float]], xlabel: str, order=()):
    """Horizontal stacked bars, one a name; one colour a part across all bars."""
    from matplotlib import colormaps

    keys = [k for k in order if any(k in p for p in parts)]
    keys += [k for p in parts for k in p if k not in keys]
    keys = list(dict.fromkeys(keys))
    cmap = colormaps["tab20"]
    y = list(range(len(names)))
    left = [0.0] * len(names)
    for j, key in enumerate(keys):
        widths = [p.get(key, 0.0) for p in parts]
        ax.barh(y, widths, left=left, color=cmap(j % 20), label=key, height=0.65)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _height(bars: int, parts: list[dict], per_bar: float = 0.45) -> float:
    """Inches for stacked bars whose legend (one entry a part) fits beside them."""
    return max(1.2 + per_bar * bars, 0.8 + 0.2 * len({k for p in parts for k in p}))


def breakdown_chart(rows: list[dict]) -> Figure | None:
    """Where each step's time goes: stacked phases (or modules) per profile row and rung."""
    items = [(r, b) for r in _first(rows) if (b := _breakdown_ms(r))]
    if not items:
        return None
    fig, (ax,) = _figure(11.0, _height(len(items), [b for _, b in items]))
    names = [n if r.get("kind") != "profile" else f"profile: {n}"
             for (r, _), n in zip(items, _labels([r for r, _ in items], width=40))]
    _stacked(ax, names, [b for _, b in items], "ms per step")
    ax.set_title("step breakdown", fontsize=10)
    return fig


MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "ema", "activations",
                "allocator slack")


def _memory_gib(row: dict) -> dict[str, float] | None:
    """A profile row's memory split in GiB: what persists, the activations, the allocator's
    slack (reserved beyond allocated)."""
    m = row.get("memory") or {}
    if row.get("kind") != "profile" or not m.get("persistent_mib"):
        return None
    parts = dict(m["persistent_mib"])
    parts["activations"] = m.get("activations_mib") or 0.0
    parts["allocator slack"] = m.get("allocator_slack_mib") or 0.0
    return {k: v / 1024 for k, v in parts.items()}


def memory_chart(rows: list[dict]) -> Figure | None:
    """Memory by category from profile rows (what persists, activations, allocator slack);
    below it peak allocated memory per rung."""
    prof = [(r, m) for r in rows if (m := _memory_gib(r))]
    peak = _first([r for r in rows if r.get("kind") in ("ladder", "peer", "inference")
                   and r.get("peak_allocated_gib") is not None])
    if not prof and not peak:
        return None
    heights = ([_height(len(prof), [m for _, m in prof])] * bool(prof)
               + [1.0 + 0.28 * len(peak)] * bool(peak))
    fig, axes = _figure(11.0, sum(heights), nrows=len(heights), height_ratios=heights)
    if prof:
        names = [f"profile: {n}" for n in _labels([r for r, _ in prof], width=30)]
        _stacked(axes[0], names, [m for _, m in prof], "GiB", order=MEMORY_PARTS)
        axes[0].set_title("memory by category (profile rows)", fontsize=10)
    if peak:
        ax = axes[-1]
        colors = {"ladder": BLUE, "peer": ORANGE, "inference": GREEN}
        y = list(range(len(peak)))
        ax.barh(y, [r["peak_allocated_gib"] for r in peak], height=0.7,
                color=[colors[r["kind"]] for r in peak])
        ax.set_yticks(y, [n.replace("\n", " ") for n in _labels(peak, width=60)], fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel="GiB", title="peak allocated per rung (blue: ladder, orange: peer, "
                                   "green: inference)")
        ax.title.set_fontsize(10)
        ax.grid(axis="x", alpha=0.3)
    return fig


def kernel_chart(rows: list[dict]) -> Figure | None:
    """GPU time per step by kernel category (GEMM, attention, elementwise…) per profile row."""
    prof = [r for r in rows if r.get("kind") == "profile"
            and (r.get("kernels") or {}).get("gpu_ms_per_step")]
    if not prof:
        return None
    fig, (ax,) = _figure(11.0, _height(len(prof), [r["kernels"]["gpu_ms_per_step"] for r in prof],
                                       per_bar=0.5))
    names = []
    for r, n in zip(prof, _labels(prof, width=30)):
        k = r["kernels"]
        names.append(f"{n}\n{k.get('launches_per_step', 0):,.0f} launches, "
                     f"idle {k.get('idle_fraction') or 0:.1%}")
    order = ("gemm", "attention", "conv", "elementwise", "norm/reduction", "optimizer",
             "memcpy", "communication", "other")
    _stacked(ax, names, [r["kernels"]["gpu_ms_per_step"] for r in prof], "GPU ms per step",
             order=order)
    ax.set_title("kernel time by category", fontsize=10)
    return fig


def scaling_chart(rows: list[dict]) -> Figure | None:
    """Per-GPU throughput and scaling efficiency against the number of processes, one line a
    sharding mode (the 1-process row starts every line)."""
    sc = [r for r in rows if r.get("kind") == "scaling" and _measured(r)
          and r.get("world_size") is not None]
    if not sc:
        return None
    fig, (ax_t, ax_e) = _figure(12.0, 4.2, ncols=2)
    groups = {(r.get("workload"), r.get("size")) for r in sc}
    for wl, size in sorted(groups, key=str):
        mine = [r for r in sc if (r.get("workload"), r.get("size")) == (wl, size)]
        single = [r for r in mine if r["world_size"] == 1]
        modes = sorted({r.get("sharding") for r in mine if r["world_size"] > 1}, key=str) or [None]
        for mode in modes:
            line = sorted(single + [r for r in mine if r["world_size"] > 1
                                    and r.get("sharding") == mode], key=lambda r: r["world_size"])
            label = (f"{wl} {size} " if len(groups) > 1 else "") + str(mode or "1 process")
            ws = [r["world_size"] for r in line]
            ax_t.plot(ws, [r["throughput"] for r in line], marker="o", label=label)
            eff = [(w, r["efficiency"]) for w, r in zip(ws, line) if r.get("efficiency") is not None]
            ax_e.plot([w for w, _ in eff], [e for _, e in eff], marker="o", label=label)
    unit = sc[0].get("throughput_unit", "")
    ax_t.set(xlabel="processes (GPUs)", ylabel=f"per-GPU throughput ({unit})",
             title="per-GPU throughput")
    ax_e.axhline(1.0, ls=":", color=GREY)
    ax_e.set(xlabel="processes (GPUs)", ylabel="efficiency",
             title="efficiency (per-GPU / best single GPU)")
    for ax in (ax_t, ax_e):
        ax.set_xticks(sorted({r["world_size"] for r in sc}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _inference(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """fasttrain's inference rungs, and the peer's (measured) rows."""
    inf = _first([r for r in rows if r.get("kind") == "inference"])
    return [r for r in inf if r.get("peer") is None], [r for r in inf if r.get("peer") is not None
                                                       and _measured(r)]


def inference_throughput_chart(rows: list[dict]) -> Figure | None:
    """Inference throughput per rung at its batch, accuracy gate (✓/✗) on each bar, the peer
    rows as lines."""
    ours, peers = _inference(rows)
    if not ours:
        return None
    fig, (ax,) = _figure(max(7.0, 0.8 * len(ours) + 3), 4.8)
    values = [r.get("throughput") if _measured(r) else None for r in ours]
    notes = [_mark((r.get("accuracy") or {}).get("passed")) for r in ours]
    top = _bars(ax, ours, values, notes, f"throughput ({ours[0].get('throughput_unit', 'img/s')})")
    ax.set_ylim(0, max([top] + [p["throughput"] for p in peers]) * 1.18)
    _peer_lines(ax, peers, lambda p: p.get("throughput"), ",.0f")
    ax.set_title(f"inference throughput at batch {ours[0].get('batch')} "
                 "(✓/✗: top-1 agreement gate)", fontsize=10)
    return fig


def inference_latency_chart(rows: list[dict]) -> Figure | None:
    """Batch-1 latency per rung: p50 bars, p90 as the error bar, the peer's p50 as lines."""
    ours, peers = _inference(rows)
    if not any(r.get("latency_ms") for r in ours):
        return None
    fig, (ax,) = _figure(max(7.0, 0.8 * len(ours) + 3), 4.8)
    lat = [r.get("latency_ms") if _measured(r) else None for r in ours]
    p50 = [(l or {}).get("p50") for l in lat]
    _bars(ax, ours, p50, [""] * len(ours), "ms")
    up = [max(l["p90"] - l["p50"], 0.0) if l else 0.0 for l in lat]
    ax.errorbar(range(len(ours)), [v or 0.0 for v in p50], yerr=[[0.0] * len(up), up],
                fmt="none", ecolor="black", capsize=4, lw=1)
    for i, (v, u) in enumerate(zip(p50, up)):
        if v:  # above the p90 cap
            ax.text(i, v + u, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    top = max([(l or {}).get("p90") or 0.0 for l in lat] + [
        (p.get("latency_ms") or {}).get("p50") or 0.0 for p in peers]) or 1.0
    ax.set_ylim(0, top * 1.2)
    _peer_lines(ax, peers, lambda p: (p.get("latency_ms") or {}).get("p50"), ".2f")
    ax.set_title("batch-1 latency: p50 (bar), p90 (error bar)", fontsize=10)
    return fig


def inference_accuracy_chart(rows: list[dict]) -> Figure | None:
    """Top-1 agreement with the fp32 logits per rung, with the gate (99%) as a line."""
    ours, _ = _inference(rows)
    if not any(r.get("accuracy") for r in ours):
        return None
    fig, (ax,) = _figure(max(7.0, 0.8 * len(ours) + 3), 4.8)
    agree = [(r.get("accuracy") or {}).get("agreement") for r in ours]
    gate = next((r["accuracy"].get("gate") for r in ours if r.get("accuracy")), None) or 0.99
    low = min([a for a in agree if a is not None] + [gate])
    floor = max(0.0, low - 2 * (1 - low) - 0.005)  # zoomed in: the gate sits near the top
    _bars(ax, ours, agree, [f"{a:.1%}" if a is not None else "" for a in agree], "agreement",
          floor=floor)
    ax.axhline(gate, ls="--", color=RED, label=f"gate {gate:.0%}")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("top-1 agreement with fp32 (✓ at or above the gate)", fontsize=10)
    return fig


def long_chart(rows: list[dict]) -> Figure | None:
    """Long-run parity: each run's loss as a mean over windows of the run (the curves the
    verdict compares), baselines in grey; beside them each switch's relative distance from its
    baseline window by window, with the tolerances."""
    from ..measure.curves import WINDOWS, window_means

    runs = [r for r in rows if r.get("kind") == "long" and len(r.get("losses") or []) >= WINDOWS]
    if not runs:
        return None
    fig, axes = _figure(12.0, 4.5, ncols=2)
    refs = {}
    for r in runs:
        w = window_means(r["losses"], WINDOWS)
        x = [(i + 0.5) * len(r["losses"]) / WINDOWS for i in range(WINDOWS)]
        label = f"{r.get('workload')} {r['rung']}" + (f" ({r['slot']})" if r.get("slot") else "")
        base = not r.get("curve") or r["curve"].get("passed") is None
        axes[0].plot(x, w, label=label, color=GREY if base else None, lw=2.5 if base else 1.2,
                     alpha=0.6 if base else 1.0)
        key = (r.get("workload"), r.get("slot"))
        if r["rung"] == "bf16-mixed":
            refs[key] = w
        elif not base and key in refs:
            dev = [abs(a - b) / abs(b) for a, b in zip(w, refs[key])]
            axes[1].plot(x, dev, label=label, lw=1.2)
    tols = {(r["curve"].get("tolerance") or {}).get("final") for r in runs if r.get("curve")}
    for tol in sorted(tols - {None}):
        axes[1].axhline(tol, ls=":", color=GREY)
        axes[1].text(0, tol, f"allowed {tol:.1%}", fontsize=7, va="bottom", color=GREY)
    axes[0].set(xlabel="step", ylabel=f"mean loss over 1/{WINDOWS} of the run",
                title="long-run loss curves (baselines grey)")
    axes[1].set(xlabel="step", ylabel="|switch − baseline| / baseline",
                title="distance from the baseline, window by window")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


@dataclass(frozen=True)
class Chart:
    """One chart of the report: its title, what it draws, and the rows it needs."""
    title: str
    draw: Callable[[list[dict]], "Figure | None"]
    needs: str


CHARTS = (
    Chart("ladder", ladder_chart, "ladder rows"),
    Chart("loss curves", loss_chart, "ladder rows with losses"),
    Chart("step breakdown", breakdown_chart, "profile rows (or ladder rows with phases)"),
    Chart("memory", memory_chart, "profile rows or rows with peak memory"),
    Chart("kernel categories", kernel_chart, "profile rows with GPU kernels"),
    Chart("long-run loss curves", long_chart, "long rows (ladder --long)"),
    Chart("scaling", scaling_chart, "scaling rows"),
    Chart("inference throughput", inference_throughput_chart, "inference rows"),
    Chart("inference latency", inference_latency_chart, "inference rows with latency"),
    Chart("inference accuracy", inference_accuracy_chart, "inference rows with accuracy"),
)
"""Every chart, in the page's order."""
