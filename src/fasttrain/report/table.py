"""The ladder table: rung, batch, ms/step, how steady the steps were, throughput, peak memory,
TFLOP/s, MFU, speed-up, parity, and what the rung did — rendered from rows only.

Under the table: the rows' warnings as numbered notes, a legend of the marks the table used,
and on a CPU a plain word on what its timings are worth. A terminal narrower than ``WIDE``
columns gets the columns that decide (``NARROW``) and the comments under the table, so that a
cell never wraps; :func:`plain_line` is one finished row for a log or a pipe."""
from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..measure.parity import unrecovered

COLUMNS = ("rung", "batch", "ms/step", "spread", "throughput", "peak GiB", "TFLOP/s", "MFU",
           "speed-up", "parity", "comment")
NARROW = ("rung", "batch", "ms/step", "throughput", "peak GiB", "speed-up", "parity")
"""The columns kept below ``WIDE`` terminal columns (80 fit them): spread becomes a ⚠ beside
ms/step, TFLOP/s and MFU go (never measured on a CPU, the row file keeps them), the comment
moves under the table."""
WIDE = 120

LEGEND = {
    "✓": "parity within tolerance of the reference",
    "✗": "parity failed, or the rung errored",
    "⚠": "unsteady step times (spread), or a numbered warning below",
    "ref": "the reference rung parity is measured against",
    "n/a": "parity not checked (the comment says why)",
    "–": "not measured here (skipped, error, or a speed-up on a CPU)",
    "no effect": "the rung's switches matched nothing: its time is the rung before's",
}
CPU_NOTE = ("CPU: these timings check the plumbing and the parity; they are not speed-ups worth "
            "quoting (speed-up shows –). Measure speed on a GPU.")


def on_cpu(row: dict) -> bool:
    """Whether the row was measured on a CPU: its ``device``, else its environment's device
    name (CUDA names a GPU vendor; a CPU is named by its processor or not at all)."""
    if row.get("device"):
        return str(row["device"]).startswith("cpu")
    name = (row.get("env") or {}).get("device_name")
    return bool(name) and not str(name).startswith(("NVIDIA", "AMD", "Tesla", "Quadro"))


def _num(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _parity(row: dict) -> str:
    p = row.get("parity")
    if not p:
        return "ref" if row.get("kind") == "ladder" and not row.get("error") and not row.get(
            "skipped") else "–"
    dev = p.get("max_rel_dev")
    if p.get("passed") is None:
        return "n/a"
    mark = "✓" if p.get("passed") else "✗"
    return f"{mark} {dev:.1e}" if dev is not None else f"{mark} {p.get('reason', '')}"


def _spread(row: dict) -> str:
    """The step times' interquartile range over their median; ⚠ where the row is unsteady."""
    s = row.get("spread")
    if not s:
        return "–"
    return f"{'' if s.get('steady', True) else '⚠ '}{s['iqr_rel'] * 100:.1f}%"


def _throughput(row: dict) -> str:
    t = row.get("throughput")
    if t is None:
        return "–"
    return (f"{t / 1000:,.1f} k" if t >= 10_000 else f"{t:,.1f}") + f" {row.get('throughput_unit', '')}"


def _name(row: dict) -> str:
    name = row.get("rung") or "?"
    if row.get("kind") == "peer":
        name = f"peer: {row.get('peer', 'public code')}" + (
            str(row.get("rung", ""))[len(row["repeat_of"]):] if row.get("repeat_of") else "")
    return name


def row_cells(row: dict, refs: list[int] | None = None) -> list[str]:
    """The row's cells in ``COLUMNS`` order. Its warnings go into the comment, or, given
    ``refs`` (their numbers under the table), as "⚠1,2"."""
    name = _name(row)
    if row.get("error"):
        return [name, str(row.get("batch", "–")), "–", "–", "–", "–", "–", "–", "–", "✗",
                f"error: {row['error']}"]
    if row.get("skipped"):
        return [name, "–", "–", "–", "–", "–", "–", "–", "–", "–", f"skipped: {row['skipped']}"]
    warn = row.get("warnings") or []
    comment = row.get("comment", "") + (
        f" [{'; '.join(warn)}]" if warn and refs is None else _refs(refs))
    return [name, str(row.get("batch")), _num(row.get("step_time_s") and row["step_time_s"] * 1e3, ",.1f"),
            _spread(row), _throughput(row), _num(row.get("peak_allocated_gib"), ".1f"),
            _num(row.get("tflops"), ",.1f" if (row.get("tflops") or 0) >= 1 else ".2g"), _num(row.get("mfu") and row["mfu"] * 100, ".1f") +
            ("%" if row.get("mfu") else ""), _speedup(row), _parity(row), comment]


def _speedup(row: dict) -> str:
    """Against the base; "no effect" where the rung's own switches matched nothing (its time
    is the rung before's plus noise: ladder.spec.mark_effect); none where the loss went NaN/inf
    and did not recover (a row written before ladder.spec.speedup withheld it)."""
    if row.get("effect") == "none":
        return "no effect"
    if unrecovered(row.get("losses") or [], row.get("scaler_skips")) is not None:
        return "–"
    if on_cpu(row):  # a ratio of CPU timings says nothing about the GPU it is meant for
        return "–"
    return _num(row.get("speedup"), ".2f") + ("×" if row.get("speedup") else "")


def peer_summary(rows: list[dict]) -> str | None:
    """'best rung X: 1.15x the peer (same run)' when a ladder has a peer row; with the peer's
    confirmation (a ``kind: ratio`` row) the ratio of both sides measured twice, and whether
    it is steady."""
    confirmed = _ratio_row(rows)
    peer = next((r for r in rows if r.get("kind") == "peer" and not r.get("error")), None)
    ours = [r for r in rows if r.get("kind") == "ladder" and r.get("throughput")
            and not r.get("repeat_of") and (r.get("parity") or {}).get("passed") is not False
            and r.get("effect") != "none"]  # no effect: the rung before, measured again
    if not peer or not ours:
        return None
    best = max(ours, key=lambda r: r["throughput"])
    if confirmed is not None:
        best = next((r for r in ours if r["rung"] == confirmed["rung"]), best)
    unit = best["throughput_unit"]
    memory = (f"peak {best.get('peak_allocated_gib') or 0:.1f} vs "
              f"{peer.get('peak_allocated_gib') or 0:.1f} GiB")
    if on_cpu(best):  # as in the table: CPU timings check the plumbing, they quote no ratio
        return (f"best fasttrain rung '{best['rung']}': {best['throughput']:,.1f} {unit}, the "
                f"peer {peer['throughput']:,.1f} (CPU: the plumbing checked; no ratio quoted)")
    if confirmed is None or confirmed.get("ratio") is None:
        note = f"; {confirmed['reason']}" if confirmed else ""
        return (f"best fasttrain rung '{best['rung']}': {best['throughput']:,.1f} {unit} = "
                f"{best['throughput'] / peer['throughput']:.2f}x the peer's "
                f"{peer['throughput']:,.1f} (same run{note}); {memory}")
    a, b = confirmed["ours_throughput"], confirmed["peer_throughput"]
    floor = confirmed.get("ratio_floor")
    verdict = "steady" if confirmed["steady"] else (
        f"⚠ NOT STEADY: {confirmed['reason']}; measure again before quoting it"
        + (f"; at least {floor:.2f}x however the runs scatter (our slowest run against the "
           "peer's fastest single step)" if floor else ""))
    return (f"best fasttrain rung '{best['rung']}': {max(a):,.1f} {unit} = "
            f"{confirmed['ratio']:.2f}x the peer's {max(b):,.1f} (the best of each side's runs "
            f"in one run, ours {_listing(a)}, the peer's {_listing(b)}: {verdict}); {memory}")


def _ratio_row(rows: list[dict]) -> dict | None:
    """The confirmation's ``kind: ratio`` row, if the ladder ran one."""
    return next((r for r in rows if r.get("kind") == "ratio"), None)


def _listing(xs: list[float]) -> str:
    return ", ".join(f"{x:,.1f}" for x in xs)


def ratio_warning(rows: list[dict]) -> str | None:
    """What to tell the user about the ratio to the peer when its confirmation did not hold
    (None when it held, or there was none)."""
    confirmed = _ratio_row(rows)
    if confirmed is None or confirmed["steady"]:
        return None
    if confirmed["ratio"] is None:
        return f"the ratio to the peer is {confirmed['reason']}"
    return (f"the ratio to the peer is not steady: {confirmed['reason']}; measure again before "
            f"quoting it")


def fast_summary(rows: list[dict]) -> str | None:
    """'fast preset: <candidate>' when the rows hold a ``--rungs fast`` verdict."""
    fast = next((r for r in rows if r.get("kind") == "fast"), None)
    if not fast:
        return None
    peer = f", {fast['vs_peer']:.2f}x the peer" if fast.get("vs_peer") and not on_cpu(fast) else ""
    if peer and fast.get("vs_peer_steady") is False:
        peer += " (not steady)"
    return (f"fast preset: '{fast['rung']}' at {fast['throughput']:,.1f} "
            f"{fast['throughput_unit']}{peer} → {fast['recipe_file']}")


def _table_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") not in ("fast", "ratio")]


def _refs(refs: list[int] | None) -> str:
    return f" ⚠{','.join(map(str, refs))}" if refs else ""


def numbered_warnings(rows: list[dict]) -> tuple[list[list[int]], list[str]]:
    """Each row's warning numbers, and the warnings as "rung: text" (number i at [i - 1]).
    A warning that an earlier rung already gave (the cumulative rungs repeat their switches'
    warnings) keeps that rung's number; a text that starts with the rung's own name is not
    prefixed with it twice."""
    refs, texts, first = [], [], {}
    for row in rows:
        mine = []
        for warning in row.get("warnings") or []:
            if warning not in first:
                name = _name(row)
                texts.append(warning if warning.startswith(f"{name}: ") else f"{name}: {warning}")
                first[warning] = len(texts)
            if first[warning] not in mine:
                mine.append(first[warning])
        refs.append(mine)
    return refs, texts


def _narrow_cells(row: dict, refs: list[int], unit: str | None) -> list[str]:
    """``NARROW``'s cells: the warnings' numbers beside the rung, an unsteady spread as ⚠
    beside ms/step, the throughput without its unit where the header carries it."""
    cells = dict(zip(COLUMNS, row_cells(row, refs)))
    cells["rung"] += _refs(refs)
    if cells["spread"].startswith("⚠"):
        cells["ms/step"] += " ⚠"
    if unit and cells["throughput"].endswith(unit):
        cells["throughput"] = cells["throughput"][:-len(unit)].strip()
    return [cells[c] for c in NARROW]


def _unit(rows: list[dict]) -> str | None:
    units = {r.get("throughput_unit") for r in rows if r.get("throughput") is not None}
    return units.pop() if len(units) == 1 else None


def rich_table(rows: list[dict], title: str | None = None, width: int | None = None) -> Table:
    """The table; below ``WIDE`` columns of ``width`` only ``NARROW``'s, with no cell wrapped
    but a long rung name (the comments and warnings then go under it: :func:`ladder_view`)."""
    caption = "\n".join(x for x in (peer_summary(rows), fast_summary(rows)) if x) or None
    rows = _table_rows(rows)
    narrow = width is not None and width < WIDE
    unit = _unit(rows) if narrow else None
    table = Table(title=title, header_style="bold", caption=caption,
                  box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD)
    for col in NARROW if narrow else COLUMNS:
        left = col in ("rung", "comment", "parity")
        table.add_column(unit if col == "throughput" and unit else col,
                         justify="left" if left else "right",
                         overflow="fold", no_wrap=narrow and col != "rung")
    refs, _ = numbered_warnings(rows)
    for row, mine in zip(rows, refs):
        style = "red" if row.get("error") or (row.get("parity") or {}).get("passed") is False else (
            "dim" if row.get("skipped") else None)
        cells = _narrow_cells(row, mine, unit) if narrow else row_cells(row, mine)
        table.add_row(*(Text(c) for c in cells), style=style)
    return table


def _marks(rows: list[dict], refs: list[list[int]], narrow: bool) -> set[str]:
    """The marks the table's cells show (rung names and comments are words, not marks)."""
    marks, unit = set(), _unit(rows) if narrow else None
    for row, mine in zip(rows, refs):
        cells = _narrow_cells(row, mine, unit)[1:] if narrow else row_cells(row, mine)[1:-1]
        for cell in cells:
            marks.update(cell.split())
            marks.update(["⚠"] if "⚠" in cell else [])
            marks.update(["no effect"] if cell == "no effect" else [])
        marks.update(["⚠"] if mine else [])
    return marks


def notes(rows: list[dict], narrow: bool = False) -> list[str]:
    """What goes under the table: (narrow) each rung's comment, the numbered warnings, the
    legend of the marks the table shows, and the CPU note where rows ran on a CPU."""
    rows = _table_rows(rows)
    refs, warnings = numbered_warnings(rows)
    lines = []
    if narrow:
        lines += [f"{_name(r)}: {c}" for r, m in zip(rows, refs)
                  if (c := row_cells(r, m)[-1].strip())]
    lines += [f"⚠{i}. {w}" for i, w in enumerate(warnings, 1)]
    shown = _marks(rows, refs, narrow)
    used = [f"{mark} = {what}" for mark, what in LEGEND.items() if mark in shown]
    if used:
        lines.append("marks: " + " · ".join(used))
    if any(on_cpu(r) and not r.get("skipped") for r in rows):
        lines.append(CPU_NOTE)
    return lines


def ladder_view(rows: list[dict], title: str | None = None, width: int | None = None) -> Group:
    """The table and its notes, for a terminal ``width`` columns wide."""
    narrow = width is not None and width < WIDE
    return Group(rich_table(rows, title, width), *(Text(n) for n in notes(rows, narrow)))


def plain_line(row: dict) -> str:
    """One finished row as one plain line (a log, a pipe): the table's cells, named."""
    cells = dict(zip(COLUMNS, row_cells(row)))
    if row.get("error") or row.get("skipped"):
        return f"{cells['rung']}: {cells['comment']}"
    peak = cells["peak GiB"] + (" GiB" if cells["peak GiB"] != "–" else "")
    return (f"{cells['rung']}: {cells['ms/step']} ms/step, {cells['throughput']}, peak {peak}, "
            f"speed-up {cells['speed-up']}, parity {cells['parity']}"
            + (f" · {cells['comment'].strip()}" if cells["comment"].strip() else ""))


def markdown_table(rows: list[dict], link: str | None = None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table_rows = _table_rows(rows)
    refs, _ = numbered_warnings(table_rows)
    for row, mine in zip(table_rows, refs):
        cells = [c.replace("|", "/") for c in row_cells(row, mine)]
        lines.append("| " + " | ".join(cells) + " |")
    for summary in (peer_summary(rows), fast_summary(rows)):
        if summary:
            lines.append(f"\n{summary}.")
    if notes(rows):
        lines.append("\n" + "\n".join(f"- {n}" for n in notes(rows)))
    if link:
        lines.append(f"\nRows: [{link}]({link})")
    return "\n".join(lines)


def load_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
