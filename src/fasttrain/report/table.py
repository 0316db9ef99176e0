"""The ladder table: rung, batch, ms/step, how steady the steps were, throughput, peak memory,
TFLOP/s, MFU, speed-up, parity, and what the rung did — rendered from rows only."""
from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

COLUMNS = ("rung", "batch", "ms/step", "spread", "throughput", "peak GiB", "TFLOP/s", "MFU",
           "speed-up", "parity", "comment")


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


def row_cells(row: dict) -> list[str]:
    name = row.get("rung") or "?"
    if row.get("kind") == "peer":
        name = f"peer: {row.get('peer', 'public code')}" + (
            str(row.get("rung", ""))[len(row["repeat_of"]):] if row.get("repeat_of") else "")
    if row.get("error"):
        return [name, str(row.get("batch", "–")), "–", "–", "–", "–", "–", "–", "–", "✗",
                f"error: {row['error']}"]
    if row.get("skipped"):
        return [name, "–", "–", "–", "–", "–", "–", "–", "–", "–", f"skipped: {row['skipped']}"]
    warn = row.get("warnings") or []
    comment = row.get("comment", "") + (f" [{'; '.join(warn)}]" if warn else "")
    return [name, str(row.get("batch")), _num(row.get("step_time_s") and row["step_time_s"] * 1e3, ",.1f"),
            _spread(row), _throughput(row), _num(row.get("peak_allocated_gib"), ".1f"),
            _num(row.get("tflops"), ",.1f" if (row.get("tflops") or 0) >= 1 else ".2g"), _num(row.get("mfu") and row["mfu"] * 100, ".1f") +
            ("%" if row.get("mfu") else ""), _speedup(row), _parity(row), comment]


def _speedup(row: dict) -> str:
    """Against the base; "no effect" where the rung's own switches matched nothing (its time
    is the rung before's plus noise: ladder.spec.mark_effect)."""
    if row.get("effect") == "none":
        return "no effect"
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
    if confirmed is None or confirmed.get("ratio") is None:
        note = f"; {confirmed['reason']}" if confirmed else ""
        return (f"best fasttrain rung '{best['rung']}': {best['throughput']:,.1f} {unit} = "
                f"{best['throughput'] / peer['throughput']:.2f}x the peer's "
                f"{peer['throughput']:,.1f} (same run{note}); {memory}")
    a, b = confirmed["ours_throughput"], confirmed["peer_throughput"]
    verdict = "steady" if confirmed["steady"] else (
        f"⚠ NOT STEADY: {confirmed['reason']}; measure again before quoting it")
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
    peer = f", {fast['vs_peer']:.2f}x the peer" if fast.get("vs_peer") else ""
    if fast.get("vs_peer") and fast.get("vs_peer_steady") is False:
        peer += " (not steady)"
    return (f"fast preset: '{fast['rung']}' at {fast['throughput']:,.1f} "
            f"{fast['throughput_unit']}{peer} → {fast['recipe_file']}")


def _table_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") not in ("fast", "ratio")]


def rich_table(rows: list[dict], title: str | None = None) -> Table:
    caption = "\n".join(x for x in (peer_summary(rows), fast_summary(rows)) if x) or None
    rows = _table_rows(rows)
    table = Table(title=title, header_style="bold", caption=caption)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("rung", "comment", "parity") else "right",
                         overflow="fold")
    for row in rows:
        style = "red" if row.get("error") or (row.get("parity") or {}).get("passed") is False else (
            "dim" if row.get("skipped") else None)
        table.add_row(*row_cells(row), style=style)
    return table


def markdown_table(rows: list[dict], link: str | None = None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in _table_rows(rows):
        cells = [c.replace("|", "/") for c in row_cells(row)]
        lines.append("| " + " | ".join(cells) + " |")
    for summary in (peer_summary(rows), fast_summary(rows)):
        if summary:
            lines.append(f"\n{summary}.")
    if link:
        lines.append(f"\nRows: [{link}]({link})")
    return "\n".join(lines)


def load_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
